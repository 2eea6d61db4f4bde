"""EngineCore: the one place where a step happens.

    core = EngineCore(config, runner)
    core.add_request(req)
    while core.has_unfinished():
        for out in core.step():      # schedule -> execute -> update -> stop -> finish
            ...

Pure and synchronous (no torch, no asyncio): the async `service.Engine`, the offline
`LLM`, the benchmarks and the tests all drive this loop; nothing else spells it out
(nano-vllm's `LLMEngine.step`, vLLM v1's `EngineCore.step`).

Faults stay with the request they belong to, and the loop lives on:
- `schedule()` raises: the requests whose own data breaks the policy are failed;
  the others drop their blocks and are recomputed (nothing sent changes). If no
  request can be blamed, every unfinished request fails once and the core goes on.
- the forward raises: each sequence is run again alone; those that fail alone are
  failed, the others keep their sampled token. A row the runner reports as failed
  (non-finite logits) fails alone.
- updating or stop-checking one request raises: that request fails.
Every failure is a `RequestOutput` with finish_reason "error" and its reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from protocol.messages import TokenLogprob
from service.core.block_pool import KVBlockPool
from service.core.config import EngineConfig
from service.core.fault_recovery import faulty_requests, reset_after_fault
from service.core.kv_cache_manager import PreemptionCost
from service.core.kv_disk import DiskTier
from service.core.request import Request
from service.core.runner import Runner
from service.core.scheduler import Scheduler
from service.core.scheduler_output import RunnerOutput, SchedulerOutput
from service.core.swap_space import SwapSpace

log = logging.getLogger(__name__)

__all__ = ["CoreStats", "EngineCore", "RequestOutput", "StepTimes"]


class RequestOutput(NamedTuple):
    """What one step did for one request.

    new_token_ids: tokens to deliver (a stop token is never one of them).
    finish_reason: "stop", "length", "cancelled" or "error" when the request ended
        (under static batching a batch member's end is held until the batch ends: its
        last tokens come first, its finish in a later output with no tokens).
    error: why, when finish_reason is "error".
    logprobs: one per new token, when the request's params ask (`logprobs`).
    prompt_logprobs: one per prompt token (None for the first), on the request's first
        output only, when its params ask (`prompt_logprobs`).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class StepTimes(NamedTuple):
    """Wall time of the last step's phases, seconds (perf_counter)."""

    schedule: float
    execute: float
    update: float


class CoreStats(NamedTuple):
    """Counters for metrics and health: requests running and waiting, KV usage (0..1),
    prefix cache queries and hits (tokens), preemptions, faults survived, and of the
    prefix hits the tokens the disk tier had loaded (0 without one)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    faults: int
    prefix_disk_hits: int = 0


class EngineCore:
    """Scheduler, KV block pool and a model runner, stepped synchronously.

    Args:
        config: engine settings (cache and scheduler parts are used here).
        runner: anything meeting `service.core.runner.Runner`.
        cost: measured preemption rates (recompute-only without them in "auto" mode).
        clock: seconds, monotonic; request timings (first token, last token) use it.
        disk: the disk KV tier over the runner's KV cache (`service.core.kv_disk`), or None.
    """

    def __init__(self, config: EngineConfig, runner: Runner, *,
                 cost: PreemptionCost | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 disk: DiskTier | None = None) -> None:
        self.config = config
        self.runner = runner
        cc = config.cache
        pool = KVBlockPool(runner.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, pool, runner.max_model_len, cache=cc,
                                   swap=SwapSpace(runner.num_swap_blocks), cost=cost,
                                   clock=clock, disk=disk)
        self.disk = disk
        self.clock = clock
        self.max_model_len = runner.max_model_len
        self.num_steps = 0
        self.num_faults = 0
        self.last_num_batched_tokens = 0
        self.last_preempted: list[str] = []  # request ids preempted by the last schedule()
        self.last_step_times = StepTimes(0.0, 0.0, 0.0)
        self._held: list[RequestOutput] = []  # static/dynamic batching: ends of the batch

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue `req` (its id must be new). Admission checks are the caller's."""
        self.scheduler.add_request(req)

    def finish_request(self, request_id: str, reason: str,
                       error: str | None = None) -> list[RequestOutput]:
        """End a request now (between steps): "cancelled" by its client, "stop" by a stop
        string, "error". Returns its final output, unless static batching holds it (then
        a later step() returns it). Unknown or finished ids give []."""
        if self.scheduler.finish_request(request_id, reason) is None:
            return []
        return self._ended(RequestOutput(request_id, [], reason, error))

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request; see finish_request."""
        return self.finish_request(request_id, "cancelled")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    @property
    def num_waiting_new(self) -> int:
        """Queued requests that never ran yet."""
        return self.scheduler.num_waiting_new

    def idle_until(self) -> float | None:
        """When a step could have work without new input (a dynamic batch coming due)."""
        return self.scheduler.idle_until()

    def stats(self) -> CoreStats:
        s, pool = self.scheduler, self.scheduler.pool
        return CoreStats(len(s.running), len(s.waiting), pool.usage,
                         pool.stats.prefix_cache_queries, pool.stats.prefix_cache_hits,
                         s.num_preemptions, self.num_faults, pool.stats.prefix_cache_disk_hits)

    def flush_disk_saves(self) -> None:
        """Hand the disk tier the blocks of requests that ended since the last step (the
        engine calls it before closing, so a cancel's blocks are not lost)."""
        self.scheduler.flush_disk_saves()

    def check_integrity(self) -> None:
        """Pool, swap space and block tables agree (call when idle: nothing may leak)."""
        self.scheduler.check_integrity()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the forward, append sampled tokens, check stops,
        finish. Returns this step's outputs (new tokens and ends); [] when nothing ran.
        Never raises for a fault of one request (see the module docstring)."""
        outputs = self._step()
        self.scheduler.flush_disk_saves()  # the blocks of requests that ended, written behind
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        try:
            out = self.scheduler.schedule()
        except Exception:
            log.exception("schedule() failed")
            return self._schedule_fault()
        t1 = time.perf_counter()
        self.last_preempted = out.preempted
        if out.is_empty:
            if out.finished_request_ids:
                self._run(out)  # lets the runner forget them
            self.last_step_times = StepTimes(t1 - t0, 0.0, 0.0)
            return self._release_held()
        result = self._execute(out)
        t2 = time.perf_counter()
        self.num_steps += 1
        self.last_num_batched_tokens = out.num_batched_tokens
        outputs: list[RequestOutput] = []
        got, failed = self.scheduler.update_from_output(out, result.sampled)
        if result.prompt_logprobs:
            self._collect_prompt_logprobs(result.prompt_logprobs)
        for rid, why in {**result.failed, **failed}.items():
            outputs += self.finish_request(rid, "error", why)
        now = self.clock()
        max_len = self.max_model_len
        for req in got:
            try:
                reason = req.check_stop(max_len)
                lps = None
                if req.stop_token_id is None:  # a token to deliver (a stop token is not)
                    new = [req.output_token_ids[-1]]
                    if req.first_token_time is None:
                        req.first_token_time = now
                    req.last_token_time = now
                    lp = result.logprobs.get(req.request_id)
                    if lp is not None:
                        lps = [lp]
                else:
                    new = []
                prompt_lps = None
                if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                    req.prompt_logprobs_sent = True
                    prompt_lps = req.prompt_logprobs or [None]
            except Exception as e:  # noqa: BLE001 -- this request's own fault
                outputs += self.finish_request(req.request_id, "error", f"{type(e).__name__}: {e}")
                continue
            output = RequestOutput(req.request_id, new, None, None, lps, prompt_lps)
            if reason is None:
                outputs.append(output)
            else:
                self.scheduler.finish_request(req.request_id, reason)
                outputs += self._ended(output._replace(finish_reason=reason))
        outputs += self._release_held()
        self.last_step_times = StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outputs

    def _collect_prompt_logprobs(self, scores: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """Append each request's new prompt-token scores (a recompute repeats some: those
        are skipped, so what is delivered never changes)."""
        for rid, (start, lps) in scores.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.prompt_logprobs_sent:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # nothing predicts the first prompt token
            have = req.prompt_logprobs
            skip = len(have) - (start + 1)  # scores of tokens start + 1 .. already held
            if 0 <= skip < len(lps):
                have.extend(lps[skip:])

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        if out.has_block_ops:
            self.runner.apply_block_ops(out)
        return self.runner.execute(out)

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        """The forward, with a failure pinned on the sequences that fail alone."""
        try:
            return self._run(out)
        except Exception as e:
            self.num_faults += 1
            log.exception("step failed (%d sequences); retrying them one by one",
                          len(out.sequences))
            first_error = f"{type(e).__name__}: {e}"
        if out.has_block_ops:
            # The copies may be half done and their sources reused: nothing can be
            # trusted, so this is the whole step's failure, as for schedule().
            return RunnerOutput({}, {s.request_id: first_error for s in out.sequences})
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        lps: dict[str, TokenLogprob] = {}
        prompt_lps: dict[str, tuple[int, list[TokenLogprob]]] = {}
        for seq in out.sequences:
            alone = SchedulerOutput([seq], len(seq.token_ids))
            try:
                result = self.runner.execute(alone)
            except Exception as e:  # noqa: BLE001
                failed[seq.request_id] = f"{type(e).__name__}: {e}"
                continue
            sampled.update(result.sampled)
            failed.update(result.failed)
            lps.update(result.logprobs)
            prompt_lps.update(result.prompt_logprobs)
        if failed:
            log.warning("step fault pinned on %s", sorted(failed))
        return RunnerOutput(sampled, failed, lps, prompt_lps)

    def _schedule_fault(self) -> list[RequestOutput]:
        """schedule() raised: fail the requests that cause it, recompute the rest."""
        self.num_faults += 1
        sched = self.scheduler
        culprits = faulty_requests(sched, self.clock())
        outputs: list[RequestOutput] = []
        try:
            reset_after_fault(sched)
        except Exception:  # noqa: BLE001 -- state beyond repair: fail everyone below
            log.exception("recovery after a schedule() failure failed")
            culprits = {}
        if not culprits:  # nobody to blame: this step fails for all, the core goes on
            why = "the scheduler failed on this step"
            culprits = {rid: why for rid in list(sched.requests)}
        for rid, why in culprits.items():
            outputs += self.finish_request(rid, "error", why)
        log.warning("schedule() fault: failed %s", sorted(culprits))
        return outputs + self._release_held()

    # ---- static batching: ends are held until the batch is done ------------------------------
    def _ended(self, output: RequestOutput) -> list[RequestOutput]:
        if output.finish_reason in ("stop", "length") and self.scheduler.batch_in_flight:
            if output.new_token_ids:  # the tokens go now, the end with the batch
                self._held.append(output._replace(new_token_ids=[], logprobs=None,
                                                  prompt_logprobs=None))
                return [output._replace(finish_reason=None)]
            self._held.append(output)
            return []
        return [output]

    def _release_held(self) -> list[RequestOutput]:
        if self._held and not self.scheduler.batch_in_flight:
            held, self._held = self._held, []
            return held
        return []
