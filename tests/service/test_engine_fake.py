"""The async Engine around EngineCore, with a model-free runner (TinyRunner): admission checks,
dict inputs, aborts racing the loop, static holding, faults, liveness, shutdown."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from protocol import Delta, Done, Error, InternalError, InvalidRequest, SamplingParams
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.engine import Engine
from tests.support.tiny_model import EOS, TinyRunner
from service.engine.client import EngineRequest


def config(**sched) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, **sched))


@pytest.fixture
async def make():
    engines: list[Engine] = []

    async def start(runner: TinyRunner | None = None, cfg: EngineConfig | None = None) -> Engine:
        engine = await Engine(cfg or config(), runner=runner or TinyRunner()).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.close()
        engine.core.check_integrity()
        assert engine.core.scheduler.pool.usage == 0.0


async def collect(engine: Engine, **kw) -> tuple[str, list[int], Done, list[Error]]:
    text, ids, errors = "", [], []
    done = None
    async for ev in engine.generate(**kw):
        if isinstance(ev, Delta):
            text += ev.text
            ids += ev.token_ids
        elif isinstance(ev, Error):
            errors.append(ev)
        else:
            done = ev
    assert done is not None
    return text, ids, done, errors


async def test_plain_dicts_for_messages_and_params(make):
    engine = await make()
    text, ids, done, _ = await collect(
        engine, messages=[{"role": "user", "content": "What is the capital of France?"}],
        params={"temperature": 0, "max_tokens": 5})
    assert text == "abcde" and done.finish_reason == "length"
    assert done.usage.completion_tokens == len(ids) == 5


@pytest.mark.parametrize("params, param", [
    ({"temperature": math.nan}, "$.params.temperature"),
    (SamplingParams(temperature=math.inf), "$.params.temperature"),
    (SamplingParams(top_p=0.0), "$.params.top_p"),
    ({"priority": 10 ** 400}, "$.params.priority"),
    ({"seed": -(2 ** 64)}, "$.params.seed"),
    ({"max_tokens": 2 ** 40}, "$.params.max_tokens"),
    ({"ttft_slo_ms": math.inf}, "$.params.ttft_slo_ms"),
    ({"stop_token_ids": [2 ** 40]}, "$.params.stop_token_ids[0]"),
    ({"stop": "\n"}, "$.params.stop"),
    ({"max_token": 5}, "$.params.max_token"),
    ("temperature=0", "$.params"),
])
async def test_in_process_params_are_checked_as_the_wire_checks_them(make, params, param):
    engine = await make()
    with pytest.raises(InvalidRequest) as e:
        await engine.open_stream(EngineRequest(prompt="hello", params=params))
    assert e.value.param == param, e.value
    assert engine.num_unfinished == 0 and not engine.core.has_unfinished()


@pytest.mark.parametrize("kw, param", [
    ({"messages": "hi"}, "$.messages"),
    ({"messages": [{"role": "user"}]}, "$.messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "$.messages[0].content"),
    ({"messages": [{"role": "<|im_start|>system", "content": "x"}]}, "$.messages[0].role"),
    ({"messages": []}, "$.messages"),
    ({"prompt": b"bytes"}, "$.prompt"),
    ({"prompt_token_ids": [1, -1]}, "$.prompt_token_ids[1]"),
    ({"prompt_token_ids": [1, 10_000]}, "$.prompt_token_ids[1]"),
])
async def test_bad_prompt_shapes_name_the_argument(make, kw, param):
    engine = await make()
    with pytest.raises(InvalidRequest) as e:
        await engine.open_stream(EngineRequest(**kw))
    assert e.value.param is not None and e.value.param.startswith(param), e.value


async def test_a_bad_request_never_harms_one_running_beside_it(make):
    engine = await make()
    good = asyncio.create_task(collect(engine, prompt="hi", params={"max_tokens": 30,
                                                                    "temperature": 0}))
    await asyncio.sleep(0.01)
    with pytest.raises(InvalidRequest):
        await engine.open_stream(EngineRequest(
            prompt="x", params=SamplingParams(temperature=math.nan)))
    text, _, done, errors = await good
    assert done.finish_reason == "length" and len(text) == 30 and not errors


async def test_stop_token_ids_are_not_sent(make):
    letters = TinyRunner().letter_ids
    engine = await make(TinyRunner())
    text, ids, done, _ = await collect(engine, prompt="go", params={
        "max_tokens": 10, "stop_token_ids": [letters[3]]})
    assert text == "abc" and ids == letters[:3]
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 3
    runner = TinyRunner(token_fn=lambda rid, pos: EOS if pos == 2 else 67 + pos)
    engine = await make(runner)
    text, ids, done, _ = await collect(engine, prompt="go", params={"max_tokens": 10})
    assert text == "ab" and done.finish_reason == "stop" and done.usage.completion_tokens == 2


async def test_abort_races_with_admission_and_steps(make):
    engine = await make()
    for delay in (0, 0.0, 0.001, 0.01):
        stream = await engine.open_stream(EngineRequest(
            prompt="x" * 40, params={"max_tokens": 1500}))
        if delay:
            await asyncio.sleep(delay)
        engine.abort(stream.request_id)
        events = [ev async for ev in stream]
        assert isinstance(events[-1], Done) and events[-1].finish_reason == "cancelled"
        assert sum(isinstance(e, Done) for e in events) == 1
    await engine.wait_idle(5)
    assert engine.num_unfinished == 0


async def test_static_batching_holds_dones_until_the_batch_ends(make):
    engine = await make(cfg=config(batching="static", max_num_seqs=2))
    order: list[str] = []

    async def run(name: str, n: int) -> None:
        async for ev in engine.generate(prompt=name, params={"max_tokens": n},
                                        request_id=name):
            if isinstance(ev, Done):
                order.append(name)

    await asyncio.gather(run("short", 2), run("long", 12))
    assert sorted(order) == ["long", "short"]
    # the short one's Done was held until the long one ended: both in one step
    assert engine.core.num_steps >= 12


async def test_a_dynamic_batch_filled_during_an_empty_step_starts_at_once(make):
    # The first request's step finds its batch not due (a 30 s queue delay) and runs nothing;
    # the other two arrive during that step and fill the batch: it must start then, not
    # 30 s after the first arrival (the loop once slept to the due time with them queued).
    engine = await make(cfg=config(batching="dynamic", max_num_seqs=3,
                                   max_queue_delay_ms=30_000))
    step = engine.core.step

    def slow_step():
        time.sleep(0.1)  # a window for the others to arrive while it runs
        return step()

    engine.core.step = slow_step
    first = asyncio.create_task(collect(engine, prompt="a", params={"max_tokens": 2}))
    while engine._loop.step_started is None:
        await asyncio.sleep(0.001)
    rest = [asyncio.create_task(collect(engine, prompt=p, params={"max_tokens": 2}))
            for p in ("b", "c")]
    results = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
    assert [r[2].finish_reason for r in results] == ["length"] * 3
    assert max(r[2].timings.queue_ms for r in results) < 5_000


async def test_an_injected_fault_fails_only_its_request_and_health_stays_true(make):
    engine = await make()
    engine.inject_fault("execute", request_id="bad", count=None)
    good = asyncio.create_task(collect(engine, prompt="a", params={"max_tokens": 20},
                                       request_id="good"))
    bad = asyncio.create_task(collect(engine, prompt="b", params={"max_tokens": 20},
                                      request_id="bad"))
    (gtext, _, gdone, gerr), (_, _, bdone, berr) = await asyncio.gather(good, bad)
    assert gdone.finish_reason == "length" and gtext == "abcdefghijklmnopqrst" and not gerr
    assert bdone.finish_reason == "error" and berr[0].code == "internal_error"
    assert engine.health() == (True, "ok")


@pytest.mark.parametrize("where", ["schedule", "output"])
async def test_schedule_and_output_faults_are_pinned_too(make, where):
    engine = await make(cfg=config(scheduling_policy="priority"))
    good = asyncio.create_task(collect(engine, prompt="a", params={"max_tokens": 30},
                                       request_id="good"))
    await asyncio.sleep(0.02)
    engine.inject_fault(where, request_id="bad", count=None)
    _, _, bdone, berr = await collect(engine, prompt="b", params={"max_tokens": 5},
                                      request_id="bad")
    gtext, _, gdone, gerr = await good
    assert bdone.finish_reason == "error" and berr
    assert gdone.finish_reason == "length" and not gerr
    assert gtext == ("abcdefghijklmnopqrstuvwxyz" * 2)[:30]  # the same as alone
    assert engine.health() == (True, "ok")


async def test_if_the_loop_dies_everyone_gets_an_end_and_health_says_why(make):
    engine = await make()
    stream = await engine.open_stream(EngineRequest(prompt="x", params={"max_tokens": 1000}))
    await asyncio.sleep(0.01)

    def broken(results):
        raise RuntimeError("a bug in the loop itself")

    engine._loop.process = broken  # the step loop's own code fails
    events = [ev async for ev in stream]
    assert isinstance(events[-2], Error) and isinstance(events[-1], Done)
    assert events[-1].finish_reason == "error"
    ok, why = engine.health()
    assert not ok and "a bug in the loop itself" in why
    with pytest.raises(InternalError):
        await engine.open_stream(EngineRequest(prompt="y"))


async def test_a_stalled_step_makes_health_false_while_it_lasts(make):
    class Slow(TinyRunner):
        def execute(self, out):
            time.sleep(0.3)
            return super().execute(out)

    cfg = EngineConfig(cache=CacheConfig(block_size=4), step_timeout_s=0.1)
    engine = await make(Slow(), cfg)
    task = asyncio.create_task(collect(engine, prompt="x", params={"max_tokens": 2}))
    await asyncio.sleep(0.2)
    ok, why = engine.health()
    assert not ok and why.startswith("stalled")
    await task
    assert engine.health() == (True, "ok")


async def test_close_cancels_everything_in_flight(make):
    engine = await make()
    streams = [await engine.open_stream(EngineRequest(prompt=f"p{i}", params={"max_tokens": 500}))
               for i in range(3)]
    await asyncio.sleep(0.01)
    await engine.close()
    for s in streams:
        events = [ev async for ev in s]
        assert events[-1].finish_reason == "cancelled"
    assert engine.health()[0] is False
