"""EngineCore with a NullRunner: the one step loop, stop tokens, aborts at every point of a
request's life, static holding, and faults pinned on the request they belong to."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.core.engine_core import EngineCore, RequestOutput
from service.core.null_runner import NullRunner
from service.core.request import Request
from service.core.scheduler_output import RunnerOutput, SchedulerOutput

EOS = 0


def make(*, runner: NullRunner | None = None, max_num_seqs: int = 8, budget: int = 16,
         num_blocks: int = 64, batching: str = "continuous", swap_blocks: int = 0,
         policy: str = "fcfs") -> EngineCore:
    runner = runner or NullRunner(num_blocks, num_swap_blocks=swap_blocks, max_model_len=512,
                                  token_fn=lambda rid, pos: 100 + pos)
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, kv_watermark_low=1.0, kv_watermark_high=1.0,
                          kv_watermark_critical=1.0),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  batching=batching, scheduling_policy=policy,
                                  preemption_mode="swap" if swap_blocks else "recompute"))
    return EngineCore(cfg, runner)


def req(rid: str, prompt: int = 6, max_tokens: int = 5, **params) -> Request:
    return Request(rid, list(range(1, prompt + 1)),
                   SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                   frozenset({EOS}))


def run(core: EngineCore, max_steps: int = 200) -> dict[str, tuple[list[int], str | None]]:
    """Step to the end: request id -> (delivered tokens, finish reason)."""
    got: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for out in core.step():
            toks, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (toks + out.new_token_ids, out.finish_reason)
    assert not core.has_unfinished(), "did not finish"
    core.check_integrity()
    assert core.scheduler.pool.usage == 0.0
    return got


def test_step_runs_requests_to_their_length():
    core = make()
    for rid in ("a", "b"):
        core.add_request(req(rid, max_tokens=4))
    assert run(core) == {"a": ([100, 101, 102, 103], "length"),
                         "b": ([100, 101, 102, 103], "length")}
    assert core.step() == []  # nothing to run: the runner is only told to forget them
    assert sorted(core.runner.forgotten) == ["a", "b"]


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_a_stop_token_is_not_delivered_nor_counted(stop):
    runner = NullRunner(64, max_model_len=512,
                        token_fn=lambda rid, pos: (EOS if stop == "eos" else 77) if pos == 2
                        else 100 + pos)
    core = make(runner=runner)
    r = req("a", max_tokens=10, stop_token_ids=(77,) if stop != "eos" else ())
    core.add_request(r)
    assert run(core) == {"a": ([100, 101], "stop")}
    assert r.output_token_ids == [100, 101] and r.stop_token_id in (EOS, 77)


def test_ignore_eos_delivers_eos_as_a_token():
    runner = NullRunner(64, max_model_len=512, token_fn=lambda rid, pos: EOS)
    core = make(runner=runner)
    core.add_request(req("a", max_tokens=3, ignore_eos=True))
    assert run(core) == {"a": ([EOS, EOS, EOS], "length")}


@pytest.mark.parametrize("steps_before_abort", [0, 1, 2, 3, 4, 5])
def test_abort_at_every_point_of_a_life_ends_it_once_and_frees_its_blocks(steps_before_abort):
    # budget 8: step 1 prefills 8 of a's 12 prompt tokens; step 2 the other 4 with a's first
    # token and b's whole prompt with b's first token; a's third token ends it at step 4
    core = make(budget=8)
    core.add_request(req("a", prompt=12, max_tokens=3))
    core.add_request(req("b", prompt=4, max_tokens=8))
    seen: list[RequestOutput] = []
    for _ in range(steps_before_abort):
        seen += core.step()
    a_ended = [o for o in seen if o.request_id == "a" and o.finish_reason]
    assert bool(a_ended) == (steps_before_abort >= 4)
    assert core.abort("a") == ([] if a_ended else [RequestOutput("a", [], "cancelled")])
    assert core.abort("a") == []  # a second cancel, or one after the end: nothing
    core.check_integrity()
    rest = run(core)
    assert "a" not in rest
    b_tokens = [t for o in seen if o.request_id == "b" for t in o.new_token_ids]
    assert b_tokens + rest["b"][0] == [100 + i for i in range(8)] and rest["b"][1] == "length"


def test_static_batching_holds_each_end_until_the_batch_is_done():
    core = make(max_num_seqs=2, batching="static")
    core.add_request(req("a", max_tokens=2))
    core.add_request(req("b", max_tokens=4))
    core.add_request(req("c", max_tokens=1))
    ends: list[tuple[int, str]] = []
    for step in range(20):
        if not core.has_unfinished():
            break
        ends += [(step, o.request_id) for o in core.step() if o.finish_reason]
    # a's end waits for b's; c runs only after both
    assert ends[0][1] == "b" and ends[1] == (ends[0][0], "a") and ends[2][1] == "c"


class FaultyRunner(NullRunner):
    """Raises in execute() while `bad` is in the batch (or `transient` more times)."""

    def __init__(self, bad: str | None = None, transient: int = 0, **kw) -> None:
        super().__init__(64, max_model_len=512, token_fn=lambda rid, pos: 100 + pos, **kw)
        self.bad = bad
        self.transient = transient

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ids = [s.request_id for s in out.sequences]
        if self.transient and ids:
            self.transient -= 1
            raise RuntimeError("transient device fault")
        if self.bad in ids:
            raise RuntimeError("this request breaks the forward")
        return super().execute(out)


def test_a_forward_fault_fails_only_the_request_that_fails_alone():
    core = make(runner=FaultyRunner(bad="bad"))
    for rid in ("a", "bad", "b"):
        core.add_request(req(rid, max_tokens=4))
    got = run(core)
    assert got["bad"][1] == "error"
    assert got["a"] == got["b"] == ([100, 101, 102, 103], "length")  # same as alone
    assert core.num_faults >= 1


def test_a_transient_forward_fault_fails_nobody():
    core = make(runner=FaultyRunner(transient=1))
    for rid in ("a", "b"):
        core.add_request(req(rid, max_tokens=3))
    assert run(core) == {"a": ([100, 101, 102], "length"), "b": ([100, 101, 102], "length")}
    assert core.num_faults == 1


def test_rows_the_runner_reports_failed_fail_alone():
    class RowFails(NullRunner):
        def execute(self, out):
            res = super().execute(out)
            if "bad" in res.sampled:
                del res.sampled["bad"]
                res.failed["bad"] = "non-finite logits"
            return res

    core = make(runner=RowFails(64, max_model_len=512, token_fn=lambda r, p: 100 + p))
    core.add_request(req("a", max_tokens=2))
    core.add_request(req("bad", max_tokens=2))
    outs = [o for _ in range(3) for o in core.step()]
    bad = [o for o in outs if o.request_id == "bad"]
    assert bad == [RequestOutput("bad", [], "error", "non-finite logits")]
    assert run(core).get("a", ([], "length"))[1] == "length"


def test_a_schedule_fault_fails_its_culprit_and_recomputes_the_rest():
    core = make(policy="priority")
    core.add_request(req("a", max_tokens=6))
    outs = core.step() + core.step()  # a runs
    policy = core.scheduler.policy
    original = policy.waiting_key

    def waiting_key(r, now):  # what a field that overflows the policy's arithmetic does
        if r.request_id == "bad":
            raise OverflowError("int too large to convert to float")
        return original(r, now)

    policy.waiting_key = waiting_key
    core.add_request(req("bad"))
    fault = core.step()
    assert fault == [RequestOutput("bad", [], "error",
                                   "OverflowError: int too large to convert to float")]
    assert core.num_faults == 1
    got = run(core)
    a_tokens = [t for o in outs if o.request_id == "a" for t in o.new_token_ids] + got["a"][0]
    # a dropped its blocks and was recomputed: nothing it had received changed
    assert a_tokens == [100, 101, 102, 103, 104, 105] and got["a"][1] == "length"
    assert core.get_request("a") is None


def test_a_schedule_fault_nobody_causes_fails_that_step_and_the_core_goes_on():
    core = make()
    core.add_request(req("a"))
    real = core.scheduler.schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        return real()

    core.scheduler.schedule = schedule
    core.step()
    outs = core.step()
    assert outs == [RequestOutput("a", [], "error", "the scheduler failed on this step")]
    core.add_request(req("later", max_tokens=2))
    assert run(core) == {"later": ([100, 101], "length")}


def test_a_block_op_fault_fails_the_step_it_belongs_to():
    class BadCopies(NullRunner):
        def apply_block_ops(self, out):
            raise RuntimeError("copy failed")

    # 2 requests, room for one: the second preempts nothing; force a swap by a tiny pool
    runner = BadCopies(6, num_swap_blocks=8, max_model_len=512, token_fn=lambda r, p: 100 + p)
    core = make(runner=runner, swap_blocks=8, budget=8)
    core.add_request(req("a", prompt=8, max_tokens=12))
    core.add_request(req("b", prompt=8, max_tokens=12))
    got = run(core)
    assert any(reason == "error" for _, reason in got.values())
    assert core.num_faults >= 1


def test_an_update_fault_fails_only_its_request():
    core = make()
    core.add_request(req("a", max_tokens=3))
    core.add_request(req("bad", max_tokens=3))
    kv = core.scheduler.kv
    real = kv.cache_full_blocks

    def cache_full_blocks(r):
        if r.request_id == "bad":
            raise ValueError("corrupt block table")
        real(r)

    kv.cache_full_blocks = cache_full_blocks
    got = run(core)
    assert got["bad"][1] == "error" and got["a"] == ([100, 101, 102], "length")


class ScoringRunner(NullRunner):
    """Scores prompt token p + 1 as -(p + 1) and each sampled token as -0.5 (fake logprobs
    whose values say which position they came from)."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        from protocol.messages import TokenLogprob

        res = super().execute(out)
        prompt = {}
        for s in out.sequences:
            if s.prompt_token_ids is not None:
                end = min(s.num_computed_tokens + len(s.token_ids), len(s.prompt_token_ids) - 1)
                prompt[s.request_id] = (s.num_computed_tokens, [
                    TokenLogprob(-(p + 1.0), []) for p in range(s.num_computed_tokens, end)])
        asking = {s.request_id for s in out.sequences if s.params.logprobs is not None}
        lps = {rid: TokenLogprob(-0.5, []) for rid in res.sampled if rid in asking}
        return RunnerOutput(res.sampled, res.failed, lps, prompt)


def test_prompt_logprobs_gathered_over_chunks_once_despite_a_recompute():
    from service.core.fault_recovery import reset_after_fault

    core = make(runner=ScoringRunner(64, max_model_len=512, token_fn=lambda r, p: 100 + p),
                budget=4)
    core.add_request(req("a", prompt=10, max_tokens=2, prompt_logprobs=0, logprobs=0))
    core.add_request(req("b", prompt=10, max_tokens=2))
    outs = core.step()  # a's first chunk: positions 0..3
    assert outs == []
    reset_after_fault(core.scheduler)  # a drops its blocks: positions 0..3 come again
    outs += [o for _ in range(30) for o in core.step()]
    a = [o for o in outs if o.request_id == "a"]
    assert a[0].prompt_logprobs[0] is None
    assert [lp.logprob for lp in a[0].prompt_logprobs[1:]] == [-float(p) for p in range(1, 10)]
    assert all(o.prompt_logprobs is None for o in a[1:])
    assert [lp.logprob for o in a for lp in (o.logprobs or [])] == [-0.5, -0.5]
    b = [o for o in outs if o.request_id == "b"]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in b)
