"""RemoteEngine's logic with a fake deployment handle (no Ray cluster, real tokenizer).

The real cluster tests (test_cluster_endpoint.py) show the same paths end to end; these
pin down each one alone: admission checks before routing, the retry when a replica
dies before admitting, a replica's refusal, a death mid-stream, and pinned aborts.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.conftest import HAVE_RAY
from service.engine.client import EngineRequest

pytestmark = pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed")

if HAVE_RAY:
    from ray.exceptions import ActorDiedError

    from protocol import (ContextLengthExceeded, Delta, Done, Error, InvalidRequest,
                          SamplingParams, ShuttingDown, Timings, Usage)
    from service.core.block_pool import KVBlockPool
    from service.engine.sampling_defaults import SamplingDefaults
    from service.cluster.ingress_metrics import IngressMetrics
    from service.cluster.messages import Admitted, ReplicaInfo, ReplicaPin, ReplicaRequest
    from service.cluster.remote_engine import RemoteEngine
    from service.engine.request_input import coerce_messages
    from service.engine.request_input import PromptTokenizer


DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9, source="test") if HAVE_RAY else None


@pytest.fixture(scope="module")
def hf_tokenizer():
    from service.bench.tokenizer import load_tokenizer

    return load_tokenizer()


class FakeStream:
    """What `handle.options(stream=True).generate.remote(...)` returns: items, maybe an
    exception after them, and cancel()."""

    def __init__(self, items: list, error: BaseException | None = None) -> None:
        self._items = list(items)
        self._error = error
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self._items:
            return self._items.pop(0)
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeMethod:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class FakeHandle:
    deployment_name = "EngineReplica"

    def __init__(self, streams: list[FakeStream]) -> None:
        self.streams = streams
        self.generate = FakeMethod(lambda request: self.streams.pop(0))

        async def abort(request_id, pin):
            return None

        self.abort = FakeMethod(abort)

    def options(self, **_):
        return self


def make_engine(tokenizer, streams: list[FakeStream]) -> tuple[RemoteEngine, FakeHandle]:
    handle = FakeHandle(streams)
    info = ReplicaInfo(model_name="SmolLM2-135M-Instruct", max_model_len=512, vocab_size=49152,
                       block_size=16, num_kv_blocks=64, tokenizer=tokenizer,
                       sampling_defaults=DEFAULTS)
    return RemoteEngine(handle, info, IngressMetrics("SmolLM2-135M-Instruct")), handle


def done(cid: str, reason: str = "length", n: int = 1) -> Done:
    return Done(id=cid, finish_reason=reason, usage=Usage(prompt_tokens=5, completion_tokens=n,
                                                         total_tokens=5 + n),
                timings=Timings())


async def drain(engine: RemoteEngine) -> None:
    assert await engine.wait_idle(5)


async def test_admits_tokenized_request_with_the_engines_block_hashes(hf_tokenizer):
    engine, handle = make_engine(hf_tokenizer, [FakeStream([
        Admitted(41, "B"), [Delta(id="r1", index=0, text="Hi", token_ids=[7])],
        [done("r1")]])])
    events: list = []
    messages = [{"role": "user", "content": "A question long enough to fill a few blocks of "
                                            "sixteen tokens each, and then some more words."}]
    n = await engine.add_request(EngineRequest(
        messages=messages, params={"max_tokens": 3}, request_id="c1/r1", client_id="r1"), events.append)
    assert n == 41
    (request,), = handle.generate.calls
    assert isinstance(request, ReplicaRequest) and request.client_id == "r1"
    ids = PromptTokenizer(hf_tokenizer, 49152)(messages=coerce_messages(messages))
    assert request.prompt_token_ids == ids
    assert list(request.block_hashes) == KVBlockPool(1, 16).block_hashes(ids)
    assert len(request.block_hashes) == len(ids) // 16 >= 2
    # unset sampling values take the model's defaults here, as the engine would
    # (repetition_penalty: the generation config's, else 1.0, which is off)
    assert request.params == SamplingParams(max_tokens=3, temperature=0.2, top_p=0.9, top_k=0,
                                            min_p=0.0, repetition_penalty=1.0)
    assert request.waited_s >= 0 and engine.sampling_defaults is DEFAULTS
    await drain(engine)
    assert [type(e) for e in events] == [Delta, Done]


async def test_bad_input_is_refused_before_anything_is_routed(hf_tokenizer):
    engine, handle = make_engine(hf_tokenizer, [])
    with pytest.raises(InvalidRequest) as e:
        await engine.add_request(EngineRequest(prompt="hi", params={"temperature": -1}), print)
    assert e.value.param == "$.params.temperature"
    with pytest.raises(ContextLengthExceeded):
        await engine.add_request(EngineRequest(
            prompt="word " * 400, params={"max_tokens": 200}), print)
    with pytest.raises(InvalidRequest):
        await engine.add_request(EngineRequest(prompt_token_ids=[49152]), print)
    engine.begin_shutdown()
    with pytest.raises(ShuttingDown):
        await engine.add_request(EngineRequest(prompt="hi"), print)
    assert handle.generate.calls == []


async def test_a_replica_dying_before_admission_is_skipped(hf_tokenizer):
    engine, handle = make_engine(hf_tokenizer, [
        FakeStream([], ActorDiedError()), FakeStream([Admitted(2, "B"), [done("r")]])])
    events: list = []
    assert await engine.add_request(EngineRequest(
        prompt="hi", request_id="k", client_id="r"), events.append) == 2
    await drain(engine)
    assert len(handle.generate.calls) == 2 and events == [done("r")]


async def test_the_replicas_refusal_is_raised_as_its_error(hf_tokenizer):
    refusal = Error(id="r", code="context_length_exceeded", param="$.params.max_tokens",
                    message="needs more KV blocks than the whole cache", retryable=False)
    engine, _ = make_engine(hf_tokenizer, [FakeStream([refusal])])
    with pytest.raises(ContextLengthExceeded, match="KV blocks"):
        await engine.add_request(EngineRequest(prompt="hi", request_id="k", client_id="r"), print)
    assert engine.num_unfinished == 0


async def test_death_mid_stream_is_a_retryable_error_then_done(hf_tokenizer):
    stream = FakeStream([Admitted(5, "A"), [Delta(id="r", index=0, text="a", token_ids=[1])],
                         [Delta(id="r", index=1, text="b", token_ids=[2])]], ActorDiedError())
    engine, _ = make_engine(hf_tokenizer, [stream])
    events: list = []
    await engine.add_request(EngineRequest(
        prompt="hi", request_id="k", client_id="r"), events.append)
    await drain(engine)
    *deltas, error, final = events
    assert len(deltas) == 2
    assert isinstance(error, Error) and error.code == "internal_error" and error.retryable
    assert error.id == "r"
    assert final.finish_reason == "error" and final.usage.completion_tokens == 2
    assert final.usage.prompt_tokens == 5 and final.timings.ttft_ms is not None


async def test_abort_is_pinned_to_the_serving_replica(hf_tokenizer):
    gate = asyncio.Event()

    class Slow(FakeStream):
        async def __anext__(self):
            if not self._items:
                await gate.wait()
                return [done("r", "cancelled", 0)]
            return await super().__anext__()

    engine, handle = make_engine(hf_tokenizer, [Slow([Admitted(5, "SERVE_REPLICA::a#E#x")])])
    events: list = []
    await engine.add_request(EngineRequest(
        prompt="hi", request_id="k", client_id="r"), events.append)
    engine.abort("k")
    engine.abort("k")  # once is enough
    engine.abort("unknown")
    await asyncio.sleep(0.05)
    assert len(handle.abort.calls) == 1
    request_id, pin = handle.abort.calls[0]
    assert request_id.endswith("/k") and pin == ReplicaPin("SERVE_REPLICA::a#E#x")
    gate.set()
    await drain(engine)
    assert events[-1].finish_reason == "cancelled"


class GatedStream(FakeStream):
    """A FakeStream whose first item waits until `gate` is set (a replica still admitting)."""

    def __init__(self, items: list, gate: asyncio.Event) -> None:
        super().__init__(items)
        self.gate = gate

    async def __anext__(self):
        await self.gate.wait()
        return await super().__anext__()


def _routed(engine: RemoteEngine) -> dict[str, float]:
    text = engine.metrics.render().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("conveyor:cluster_requests_routed_total{"):
            out[line.split('replica="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _in_flight(engine: RemoteEngine) -> float:
    text = engine.metrics.render().decode()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                      if line.startswith("conveyor:cluster_requests_in_flight ")))


@pytest.mark.parametrize("outcome", ["admitted", "refused"])
async def test_a_request_cancelled_during_admission_is_counted_where_it_was_admitted(
        hf_tokenizer, outcome):
    gate = asyncio.Event()
    first = Admitted(5, "B") if outcome == "admitted" else Error(
        id="r1", code="overloaded", param=None, message="busy", retryable=True)
    stream = GatedStream([first], gate)
    engine, handle = make_engine(hf_tokenizer, [stream])
    engine.metrics.track_in_flight(lambda: engine.num_unfinished)
    task = asyncio.ensure_future(engine.add_request(EngineRequest(
        prompt="hello", params={"max_tokens": 3}, request_id="c1/r1", client_id="r1"), lambda e: None))
    for _ in range(500):  # until the request is at the replica (tokenized, sent)
        await asyncio.sleep(0.01)
        if handle.generate.calls:
            break
    assert handle.generate.calls
    assert _in_flight(engine) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished == 1 and _in_flight(engine) == 1  # the admission goes on
    gate.set()
    await drain(engine)
    assert _in_flight(engine) == 0
    if outcome == "admitted":  # counted where it was admitted, and cancelled there
        assert _routed(engine) == {"B": 1.0} and stream.cancelled
    else:  # refused: no replica holds it, none counts it
        assert _routed(engine) == {} and not stream.cancelled


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}


class FakeReplicaEngine:
    """What EngineReplica.generate needs of its engine: add_request (recorded) and abort."""

    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []

    async def add_request(self, request: EngineRequest, sink) -> int:
        self.requests.append(request)
        sink(done(request.client_id, "tool_calls"))
        return len(request.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        pass


async def test_tools_and_output_constraints_reach_the_replica_and_constrain_it_there(
        hf_tokenizer):
    from service.cluster.replica import EngineReplica
    from service.engine.admission import Admission
    from service.engine.constraints.tools import ToolPlan

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tool_request = EngineRequest(messages=messages, params={"max_tokens": 40}, tools=[WEATHER],
                                 tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}},
                                 parallel_tool_calls=True, request_id="k1", client_id="r1")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    format_request = EngineRequest(messages=messages, request_id="k2", client_id="r2", params={
        "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}}})
    engine, handle = make_engine(hf_tokenizer, [
        FakeStream([Admitted(30, "B"), [done("r1", "tool_calls")]]),
        FakeStream([Admitted(30, "B"), [done("r2", "stop")]])])
    await engine.add_request(tool_request, lambda e: None)
    await engine.add_request(format_request, lambda e: None)
    await drain(engine)
    (routed_tools,), (routed_format,) = handle.generate.calls
    # the ingress rendered the prompt with the tools (the generic style's system prompt)
    pt = PromptTokenizer(hf_tokenizer, 49152)
    plan = ToolPlan.make([msgspec_tool(WEATHER)], routed_tools.tool_choice, "generic",
                         parallel=True)
    assert routed_tools.prompt_token_ids == pt(messages=coerce_messages(messages), tools=plan)
    assert [t.function.name for t in routed_tools.tools] == ["get_weather"]
    assert routed_tools.tool_choice.function.name == "get_weather"
    assert routed_tools.parallel_tool_calls is True and routed_tools.tool_style == "generic"
    assert routed_format.tools is None and routed_format.tool_style is None
    assert routed_format.params.response_format.json_schema.schema == schema

    # the replica hands them to its engine, whose admission builds the same constraint
    # as a one-process engine given the original request
    class Replica(EngineReplica):  # no Ray, no engine start-up, no shutdown on collection
        def __init__(self) -> None:
            self.replica_id, self.engine = "B", FakeReplicaEngine()

        def __del__(self) -> None:
            pass

    replica = Replica()
    for routed in (routed_tools, routed_format):
        first = [item async for item in replica.generate(routed)][0]
        assert first == Admitted(len(routed.prompt_token_ids), "B")
    at_replica, at_replica_format = replica.engine.requests
    admission = Admission(hf_tokenizer, 49152, 512, 64, 16, DEFAULTS, eos_token_ids=[2])
    try:
        local = await admission.prepare_full(tool_request)
        remote = await admission.prepare_full(at_replica)
        assert remote.ids == local.ids and remote.tool_format == local.tool_format
        assert remote.matcher is not None and local.matcher is not None
        assert remote.params == local.params
        remote_format = await admission.prepare_full(at_replica_format)
        assert remote_format.matcher is not None and remote_format.tool_format is None
        # a tool call's text is accepted by the replica's matcher, plain text is not
        call = '{"tool_call":{"name":"get_weather","arguments":{"city":"Paris"}}}'
        ids = hf_tokenizer.encode(call, add_special_tokens=False)
        assert remote.matcher.validate_tokens(ids) == len(ids)
        other = remote_format.matcher  # a fresh one: nothing consumed
        plain = hf_tokenizer.encode("Hello there", add_special_tokens=False)
        assert other.validate_tokens(plain) < len(plain)
    finally:
        admission.close()


def msgspec_tool(raw: dict):
    import msgspec

    from protocol.structured import Tool

    return msgspec.convert(raw, Tool)
