"""One conformance check of the EngineClient contract, run against every engine that
claims it (the in-process Engine here, the cluster's RemoteEngine in
tests/cluster/test_engine_client_cluster.py)."""

from __future__ import annotations

import asyncio

import pytest

from protocol import (ContextLengthExceeded, Delta, Done, InvalidRequest, ShuttingDown)
from service.engine.client import ENGINE_CLIENT_MEMBERS, EngineClient
from service.engine.stream import RequestStream
from service.engine.client import EngineRequest


async def check_engine_client(engine: EngineClient, *, max_tokens: int = 4) -> None:
    """Every member there; a request streams Deltas then its Done, by sink and by stream;
    bad input is refused naming the field; a request larger than the KV cache is refused at
    once; abort ends a request with Done "cancelled"; health, metrics, drain."""
    assert isinstance(engine, EngineClient)
    for name in ENGINE_CLIENT_MEMBERS:
        assert hasattr(engine, name), name
    assert isinstance(engine.model_name, str) and engine.model_name
    assert engine.max_model_len > 0 and engine.kv_cache_tokens > 0
    assert set(engine.sampling_defaults.as_dict()) == {"temperature", "top_p", "top_k", "min_p"}
    assert engine.health() == (True, "ok") and engine.accepting

    # by sink: the prompt length comes back, then every event goes to the sink
    events: list = []
    n = await engine.add_request(EngineRequest(prompt="Once upon a time", request_id="k1", client_id="r1", params={"max_tokens": max_tokens, "ignore_eos": True,
                                         "temperature": 0}), events.append)
    assert isinstance(n, int) and n > 0
    assert await engine.wait_idle(60)
    assert isinstance(events[-1], Done) and events[-1].id == "r1"
    assert events[-1].finish_reason == "length"
    deltas = [e for e in events if isinstance(e, Delta)]
    assert sum(len(d.token_ids) for d in deltas) == events[-1].usage.completion_tokens \
        == max_tokens
    # by stream
    stream = await engine.open_stream(EngineRequest(
        messages=[{"role": "user", "content": "Hi"}],
        params={"max_tokens": 2, "ignore_eos": True}))
    assert isinstance(stream, RequestStream)
    got = [e async for e in stream]
    assert isinstance(got[-1], Done) and got[-1].usage.completion_tokens == 2

    # logprobs: one score per token, the prompt's with the first delta (through Ray too)
    stream = await engine.open_stream(EngineRequest(prompt="One, two, three,", params={"max_tokens": 3, "ignore_eos": True,
                                              "temperature": 0, "logprobs": 2,
                                              "prompt_logprobs": 1}))
    got = [e async for e in stream]
    deltas = [e for e in got if isinstance(e, Delta)]
    assert deltas[0].prompt_logprobs is not None and deltas[0].prompt_logprobs[0] is None
    assert len(deltas[0].prompt_logprobs) == len(deltas[0].prompt_token_ids) \
        == got[-1].usage.prompt_tokens
    assert all(len(lp.top) == 1 for lp in deltas[0].prompt_logprobs[1:])
    scores = [lp for d in deltas for lp in d.logprobs]
    assert len(scores) == sum(len(d.token_ids) for d in deltas) == 3
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob for lp in scores)

    # refusals, before anything is queued
    with pytest.raises(InvalidRequest) as e:
        await engine.add_request(EngineRequest(prompt="hi", params={"temperature": -1}), print)
    assert e.value.param == "$.params.temperature"
    too_many = engine.kv_cache_tokens + 1
    with pytest.raises(ContextLengthExceeded):
        await engine.add_request(EngineRequest(
            prompt_token_ids=[1, 2, 3], params={"max_tokens": too_many}), print)

    # abort mid-stream
    events = []
    await engine.add_request(EngineRequest(prompt="Count to a thousand:", request_id="k2", client_id="r2", params={"max_tokens": min(engine.max_model_len,
                                                       engine.kv_cache_tokens) - 64,
                                     "ignore_eos": True}), events.append)
    await asyncio.sleep(0.05)
    engine.abort("k2")
    engine.abort("no-such-request")
    assert await engine.wait_idle(60)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"

    text = await engine.metrics_text()
    assert isinstance(text, bytes) and b"conveyor:" in text

    # drain
    engine.begin_shutdown()
    assert not engine.accepting and not engine.health()[0]
    with pytest.raises(ShuttingDown):
        await engine.add_request(EngineRequest(prompt="hi"), print)
    assert await engine.wait_idle(1) and engine.num_unfinished == 0
