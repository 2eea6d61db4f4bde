"""The generation config's `max_new_tokens` as the default output limit, with the real model,
on every front end: the in-process Engine, `LLM`, /v1/stream and /v1/responses (a real
server on port 0). A request that sets no limit gets max_new_tokens; an explicit limit
wins above or below it; the context (here a small KV cache) still caps the default. And
`top_k: 1` in a generation config is a start-up warning.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import structlog
import websockets

from protocol import ContextLengthExceeded, Done, connect
from service.config import ServerConfig
from service.engine import Engine
from service.engine.llm import LLM
from service.engine.client import EngineRequest
from service.front.server import FrontServer
from tests.integration.conftest import engine_config

pytestmark = pytest.mark.model

DEFAULT = 5
PROMPT = "Count from one to one hundred: one, two, three,"


def _config(tmp_path, values: dict, **kw):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    base = engine_config(**kw)
    return dataclasses.replace(base, model=dataclasses.replace(
        base.model, generation_config=str(tmp_path)))


async def _tokens(engine: Engine, **params) -> int:
    done = None
    async for event in engine.generate(prompt=PROMPT, params={"temperature": 0.0,
                                                              "ignore_eos": True, **params}):
        done = event if isinstance(event, Done) else done
    assert done is not None
    return done.usage.completion_tokens


async def test_engine_defaults_to_max_new_tokens_and_an_explicit_limit_wins(
        tmp_path, loaded_model):
    with structlog.testing.capture_logs() as logs:
        engine = await Engine(_config(tmp_path, {"max_new_tokens": DEFAULT}),
                              loaded=loaded_model).start()
    try:
        line = next(e for e in logs if e["event"] == "sampling_defaults")
        assert line["default_max_tokens"] == DEFAULT
        assert line["default_max_tokens_from"] == "max_new_tokens"
        assert not [e for e in logs if e["event"] == "sampling_defaults_greedy"]
        assert await _tokens(engine) == DEFAULT
        assert await _tokens(engine, max_tokens=DEFAULT + 4) == DEFAULT + 4  # never a cap
        assert await _tokens(engine, max_tokens=2) == 2
    finally:
        await engine.close()


async def test_the_context_still_caps_the_default(tmp_path, loaded_model):
    # 8 blocks of 16: a request may span 128 tokens; the default asks for far more
    engine = await Engine(_config(tmp_path, {"max_new_tokens": 100_000}, num_kv_blocks=8),
                          loaded=loaded_model).start()
    try:
        prompt = len(engine.tokenizer.encode(PROMPT))
        assert await _tokens(engine) == 128 - prompt
        with pytest.raises(ContextLengthExceeded):  # an explicit value is checked, not cut
            await _tokens(engine, max_tokens=100_000)
    finally:
        await engine.close()


async def test_without_max_new_tokens_an_unset_limit_is_the_room_left(tmp_path, loaded_model):
    engine = await Engine(_config(tmp_path, {"temperature": 0.5}), loaded=loaded_model).start()
    try:
        ids, params = await engine._admission.prepare(EngineRequest(prompt=PROMPT,
                                                                    client_id="x"))
        assert params.max_tokens == engine._admission.room - len(ids)  # vLLM's rule
    finally:
        await engine.close()


async def test_stream_and_responses_sockets_default_to_max_new_tokens(tmp_path, loaded_model):
    engine = await Engine(_config(tmp_path, {"max_new_tokens": DEFAULT}),
                          loaded=loaded_model).start()
    server = await FrontServer(engine, ServerConfig(port=0)).start()
    try:
        async with await connect(server.url) as client:
            done = None
            async for event in client.generate(prompt=PROMPT, temperature=0, ignore_eos=True):
                done = event if isinstance(event, Done) else done
            assert done.usage.completion_tokens == DEFAULT
            async for event in client.generate(prompt=PROMPT, temperature=0, ignore_eos=True,
                                               max_tokens=DEFAULT + 3):
                done = event if isinstance(event, Done) else done
            assert done.usage.completion_tokens == DEFAULT + 3

        async def respond(**create) -> dict:
            async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/responses") as ws:
                await ws.send(json.dumps({"type": "response.create", "input": PROMPT,
                                          "temperature": 0, **create}))
                while True:
                    event = json.loads(await ws.recv())
                    if event["type"] in ("response.completed", "response.incomplete",
                                         "response.failed", "error"):
                        return event

        event = await respond()
        assert event["type"] == "response.incomplete", event
        assert event["response"]["usage"]["output_tokens"] == DEFAULT
        assert event["response"]["incomplete_details"]["reason"] == "max_output_tokens"
        event = await respond(max_output_tokens=DEFAULT + 3)
        assert event["response"]["usage"]["output_tokens"] == DEFAULT + 3, event
    finally:
        await server.close()
        await engine.close()


def test_llm_defaults_to_max_new_tokens(tmp_path, loaded_model):
    llm = LLM(loaded=loaded_model, config=_config(tmp_path, {"max_new_tokens": DEFAULT}))
    ids = llm.tokenizer.encode(PROMPT) if hasattr(llm, "tokenizer") else [1, 2, 3, 4]
    out = llm.generate([ids, ids], [{"temperature": 0.0, "ignore_eos": True},
                                    {"temperature": 0.0, "ignore_eos": True, "max_tokens": 7}])
    assert [len(o) for o in out] == [DEFAULT, 7]


def test_top_k_1_in_a_generation_config_warns_that_sampling_is_greedy(tmp_path, loaded_model):
    with structlog.testing.capture_logs() as logs:
        LLM(loaded=loaded_model, config=_config(tmp_path, {"top_k": 1, "temperature": 0.7}))
    warned = [e for e in logs if e["event"] == "sampling_defaults_greedy"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    assert "greedily" in warned[0]["message"] and "top_k 1" in warned[0]["message"]
