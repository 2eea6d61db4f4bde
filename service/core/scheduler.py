"""Continuous batching scheduler (iteration-level scheduling, Orca, OSDI 2022).

Before every forward the batch is rebuilt: finished requests have already left,
running requests get their next token(s), waiting requests fill what is left of
the token budget (`max_num_batched_tokens`) and sequence cap (`max_num_seqs`).
Prefill is chunked: a long prompt takes several steps, mixed with other
sequences' decodes. Which blocks each request gets is the KVCacheManager's job.

KV pressure (DESIGN.md, "Actors"):
- above `kv_watermark_high` no new request starts; admission reopens below
  `kv_watermark_low` (hysteresis, so admission does not flap at one level);
- above `kv_watermark_critical` running requests are preempted until usage is
  back under it (at least one keeps running);
- when a running request needs a block and none is free, the policy's victim is
  preempted, by swap or recompute (`service.core.kv_cache_manager`).

No deadlock and no starvation by preemption: admission guarantees that any single
request fits the whole pool; when blocks run short one victim at a time is
preempted and the rest go on (the request that needs the block may be its own
victim, which frees room for the others); preempted requests are resumed before
any new request is admitted, and in policy order, so under FCFS the oldest
request is never preempted while a newer one runs: it finishes at the latest
when it is alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.core.batching import BatchFormer
from service.core.block_pool import KVBlockPool
from service.core.config import CacheConfig, SchedulerConfig
from service.core.kv_cache_manager import BlockOps, KVCacheManager, PreemptionCost
from service.core.kv_disk import DiskTier
from service.core.policy import Policy, make_policy
from service.core.request import Request, RequestStatus
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from service.core.swap_space import SwapSpace

__all__ = ["PreemptionCost", "Scheduler"]

DISK_POLL_S = 0.002  # how often an idle step loop looks for finished disk loads


@dataclass
class _Step:
    """Scratch state of one schedule() call."""

    budget: int
    sequences: list[ScheduledSequence] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)
    ops: BlockOps = field(default_factory=BlockOps)
    short_of_blocks: bool = False  # a preemption freed blocks: admit nothing new this step
    # prefill chunks held to `_prefill_cap`: (index in sequences, request, tokens given)
    capped: list[tuple[int, Request, int]] = field(default_factory=list)


class Scheduler:
    """Owns the waiting and running sets and, through its KVCacheManager, the KV block pool
    and the swap space (sync, no I/O).

    Args:
        config: token budget, sequence cap, preemption mode, policy, batching mode.
        pool: the KV block pool (only this object's KVCacheManager calls it).
        max_model_len: context cap in tokens.
        cache: watermarks (kv_watermark_high / low / critical).
        swap: CPU swap space; None disables swapping.
        cost: measured rates for preemption_mode "auto" (recompute when None).
        clock: seconds, monotonic (tests pass a fake one).
        disk: the disk KV tier (read-ahead and write-behind, `service.core.disk_prefix`);
            None when off.
    """

    def __init__(self, config: SchedulerConfig, pool: KVBlockPool, max_model_len: int, *,
                 cache: CacheConfig | None = None, swap: SwapSpace | None = None,
                 cost: PreemptionCost | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 disk: DiskTier | None = None) -> None:
        self.config = config
        self.pool = pool
        self.kv = KVCacheManager(pool, swap, config.preemption_mode, cost, disk)
        self.max_model_len = max_model_len
        self.cache = cache or CacheConfig()
        self.clock = clock
        self.policy: Policy = make_policy(config.scheduling_policy, config.policy,
                                          cost.prefill_tokens_per_s if cost else None)
        self.batching = BatchFormer(config)  # static/dynamic: the batch in flight
        self.num_schedule_calls = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admitting = True  # watermark hysteresis state
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputes = 0
        self._finished_ids: list[str] = []  # since the last schedule(): for the runner
        self._step: _Step | None = None  # the step being built (fault recovery reads it)

    # ---- membership ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_new(self) -> int:
        """Waiting requests that never ran (the admission queue's length)."""
        return sum(1 for r in self.waiting if r.status is RequestStatus.WAITING)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """End a request (stop, length, cancelled, error): free its blocks, drop it.

        Returns the request, or None when the id is unknown or already finished.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        self.kv.free(req, save=reason != "error" and req.status is RequestStatus.RUNNING)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.batching.discard(request_id)
        self._finished_ids.append(request_id)
        self.policy.on_finish(req)
        return req

    @property
    def batch_in_flight(self) -> bool:
        """Static/dynamic batching: True while members of the current batch are unfinished."""
        return self.batching.in_flight

    def idle_until(self) -> float | None:
        """When an empty step could turn non-empty without new input (a dynamic batch's
        queue delay running out, or a disk load finishing: polled every 2 ms), in clock
        seconds; None when only new input can."""
        due = self.batching.idle_until(self.waiting)
        if self.kv.disk is not None and self.kv.disk.has_loads():
            soon = self.clock() + DISK_POLL_S
            due = soon if due is None else min(due, soon)
        return due

    def flush_disk_saves(self) -> None:
        """Hand the blocks of requests that ended to the disk tier (EngineCore calls it at
        the end of each step, before a later allocation can reuse them)."""
        if self.kv.disk is not None:
            self.kv.disk.flush()

    # ---- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their blocks.

        Invariant (after vLLM v1): there is no prefill phase and no decode phase.
        Every request has num_computed_tokens; each step hands it a share of the
        token budget so that it catches up with num_tokens (prompt + output).
        Chunked prefill, prefix cache hits, recompute after preemption and decode
        are one code path. Decodes are served before prefill chunks so that a long
        prompt never stalls the streams already running.
        """
        now = self.clock()
        st = self._step = _Step(self.config.max_num_batched_tokens)
        disk = self.kv.disk
        if disk is not None:  # before any allocation: ended requests' blocks, then loads
            disk.flush()
            disk.poll(self.cache.kv_watermark_high)
        self._relieve_critical(st, now)
        self._preempt_for_priority(st, now)
        self._schedule_running(st, now)
        usage = self.pool.usage
        if usage >= self.cache.kv_watermark_high:
            self.admitting = False
        elif usage < self.cache.kv_watermark_low:
            self.admitting = True
        if not st.short_of_blocks:
            candidates = self._admission_candidates(now)
            if candidates and disk is not None and self.admitting:
                disk.start_loads(candidates, self.kv.full_block_hashes)
            if candidates:
                self._schedule_waiting(candidates, st, now)
        self._top_up_capped(st)
        self.num_schedule_calls += 1
        finished, self._finished_ids = tuple(self._finished_ids), []
        self._step = None
        return SchedulerOutput(st.sequences, self.config.max_num_batched_tokens - st.budget,
                               st.preempted, st.ops.swap_out, st.ops.swap_in, st.ops.copies,
                               finished)

    def _relieve_critical(self, st: _Step, now: float) -> None:
        while self.pool.usage > self.cache.kv_watermark_critical and len(self.running) > 1:
            self._preempt(self._pick_victim(st, now), st)
            st.short_of_blocks = True

    def _admission_candidates(self, now: float) -> list[Request]:
        """Waiting requests that may start this step, in the policy's order (see
        service.core.batching for what each batching mode allows)."""
        if not self.waiting:
            return []
        order = sorted(self.waiting, key=lambda r: self.policy.waiting_key(r, now))
        return self.batching.candidates(order, len(self.running), self.num_schedule_calls, now)

    def _preempt_for_priority(self, st: _Step, now: float) -> None:
        """Preemptive policies: while the best waiting request finds no room (sequence cap
        or blocks) and outranks the worst running one, that one is preempted."""
        if not self.waiting or not self.running or self.config.batching != "continuous":
            return
        best = min(self.waiting, key=lambda r: self.policy.waiting_key(r, now))
        first_chunk = min(best.num_tokens, self.config.max_num_batched_tokens)
        while self.running:
            room = len(self.running) < self.config.max_num_seqs and \
                self.pool.can_allocate(self.pool.blocks_needed(first_chunk))
            if room:
                return
            victim = max(self.running, key=lambda r: self.policy.victim_key(r, now))
            if not self.policy.outranks(best, victim, now):
                return
            self._preempt(victim, st)

    def _prefill_cap(self, now: float) -> int | None:
        """The most tokens a running request's prefill chunk takes this step, or None (no
        cap): `long_prefill_token_threshold` (default half the budget) while a waiting
        request may start this step. Without it a long prompt's chunks took every step's
        whole budget until it was done, and a short request that arrived meanwhile waited
        for all of them (an 8,100-token prompt held a 37-token chat's first token 10.4 s on
        2 cores); with it the newcomer's prompt goes into the next step beside the long
        one's chunk, which gets back what the newcomers leave (`_top_up_capped`) and the
        whole budget when none waits. (vLLM's option of this name caps a long prompt's
        chunks always.)"""
        cap = self.config.long_prefill_token_threshold
        if cap is None:
            cap = max(1, self.config.max_num_batched_tokens // 2)
        if cap == 0 or not self.waiting or not self.admitting or \
                len(self.running) >= self.config.max_num_seqs or \
                self.config.batching != "continuous":  # a static batch admits no newcomer
            return None
        # whether any may start (continuous: all, but between --schedule-interval steps);
        # unsorted: the policy's order does not change whether the list is empty
        return cap if self.batching.candidates(self.waiting, len(self.running),
                                               self.num_schedule_calls, now) else None

    def _schedule_running(self, st: _Step, now: float) -> None:
        decodes, chunks = [], []
        for r in self.running:
            (decodes if len(r.prompt_token_ids) + len(r.output_token_ids)
             - r.num_computed_tokens == 1 else chunks).append(r)
        cap = self._prefill_cap(now) if chunks else None
        running = RequestStatus.RUNNING
        owns_next_slot = self.kv.owns_next_slot
        for req in decodes + chunks:  # decodes first
            if st.budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            start = req.num_computed_tokens
            if start + 1 == len(req.prompt_token_ids) + len(req.output_token_ids) and \
                    owns_next_slot(req):
                # Fast path, every step of every decode: its slot is in a block it owns
                # alone, so nothing to allocate or copy (what allocate and _emit would
                # conclude, without their calls; measured by service.bench.scheduler_overhead).
                last = req.output_token_ids[-1] if req.output_token_ids else \
                    req.prompt_token_ids[-1]
                st.sequences.append(ScheduledSequence(req.request_id, [last], start,
                                                      req.block_ids, True, req.params, None,
                                                      req.token_history, req.constraint))
                st.scheduled.add(req.request_id)
                st.budget -= 1
                continue
            n = min(len(req.prompt_token_ids) + len(req.output_token_ids)
                    - req.num_computed_tokens, st.budget)
            capped = cap is not None and n > cap  # a prefill chunk, while others wait
            if capped:
                n = cap
            while not self.kv.allocate(req, n, st.ops):
                victim = self._pick_victim(st, now)
                self._preempt(victim, st)
                st.short_of_blocks = True
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                if capped:
                    st.capped.append((len(st.sequences), req, n))
                self._emit(req, n, st)

    def _top_up_capped(self, st: _Step) -> None:
        """Give the budget the waiting requests left unused (they could not all start: the
        sequence cap, the KV blocks) back to the prefill chunks `_prefill_cap` held back, in
        order, where their blocks can be had without preempting anyone."""
        for i, req, n in st.capped:
            if st.budget == 0:
                return
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted since: nothing to extend
            more = min(req.num_tokens - req.num_computed_tokens - n, st.budget)
            if more > 0 and self.kv.allocate(req, n + more, st.ops):
                st.sequences[i] = self._sequence(req, n + more)
                st.budget -= more

    def _schedule_waiting(self, order: list[Request], st: _Step, now: float) -> None:
        for req in order:
            if st.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.status is RequestStatus.WAITING and not self.admitting:
                return  # above the high watermark: no new prefill until below the low one
            if req.disk_loading:
                continue  # its prefix is being read from disk: the others go meanwhile
            # A resumed request may not push usage over the high watermark (unless it runs
            # alone), so critical-watermark preemption cannot thrash with resumption.
            cap = self.cache.kv_watermark_high if self.running else None
            if req.status is RequestStatus.SWAPPED:
                ok = self.kv.swap_in(req, st.budget, cap, st.ops)
            else:
                ok = self.kv.start(req, st.budget,
                                   cap if req.status is RequestStatus.PREEMPTED else None)
            if not ok:
                return  # head-of-line: keep the policy's order
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._emit(req, min(req.num_tokens - req.num_computed_tokens, st.budget), st)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]
                           ) -> tuple[list[Request], dict[str, str]]:
        """Advance each scheduled request by its computed tokens, append sampled tokens.

        Returns (the requests that got a new token, in schedule order; request id ->
        error for those whose update raised: the caller fails them, the rest go on).
        Full blocks computed this step enter the prefix cache (and, once a prompt is
        done, the disk tier's write queue: a long-running request's prompt is on disk
        before it ends). Requests finished
        meanwhile (a cancel that raced the step) are skipped.
        """
        got: list[Request] = []
        failed: dict[str, str] = {}
        requests, bs, running = self.requests, self.pool.block_size, RequestStatus.RUNNING
        disk = self.kv.disk
        for seq in output.sequences:
            req = requests.get(seq.request_id)
            if req is None or req.status is not running:
                continue
            try:  # free in Python 3.11 unless it raises
                req.num_computed_tokens += len(seq.token_ids)
                if req.num_computed_tokens // bs > req.num_registered_blocks:
                    self.kv.cache_full_blocks(req)
                    if disk is not None and req.output_token_ids:
                        disk.note_decoded_blocks(req)  # a long-running request
                token = sampled.get(seq.request_id)
                if token is not None:
                    if not req.output_token_ids and disk is not None:
                        disk.note_blocks(req)  # its prompt is in: write it behind now
                    req.output_token_ids.append(token)
                    got.append(req)
            except Exception as e:  # noqa: BLE001 -- pinned on this request only
                failed[seq.request_id] = f"{type(e).__name__}: {e}"
        return got, failed

    # ---- helpers -------------------------------------------------------------------
    def _emit(self, req: Request, n: int, st: _Step) -> None:
        st.sequences.append(self._sequence(req, n))
        st.scheduled.add(req.request_id)
        st.budget -= n

    def _sequence(self, req: Request, n: int) -> ScheduledSequence:
        """The step's entry for the next n tokens of `req` (its blocks already allocated)."""
        start = req.num_computed_tokens
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if n == 1 and start + 1 == num_tokens:  # a decode: its last sampled token
            token_ids = [req.output_token_ids[-1] if req.output_token_ids
                         else req.prompt_token_ids[-1]]
        else:
            token_ids = req.token_slice(start, start + n)
        # the prompt, while its logprobs are asked for and not all computed yet
        prompt = req.prompt_token_ids if req.params.prompt_logprobs is not None and \
            not req.output_token_ids else None
        # positional: this runs for every sequence of every step
        samples = start + n == num_tokens
        return ScheduledSequence(req.request_id, token_ids, start, req.block_ids, samples,
                                 req.params, prompt, req.token_history if samples else None,
                                 req.constraint)

    def _pick_victim(self, st: _Step, now: float) -> Request:
        """The policy's victim among running requests not yet in this step."""
        candidates = [r for r in self.running if r.request_id not in st.scheduled]
        assert candidates, "no preemption candidate: the current request is always one"
        return max(candidates, key=lambda r: self.policy.victim_key(r, now))

    def _preempt(self, req: Request, st: _Step) -> None:
        """Swap `req` out or drop its blocks for recompute; it rejoins the waiting set."""
        self.running.remove(req)
        if self.kv.preempt(req, st.ops):
            self.num_swaps += 1
        else:
            self.num_recomputes += 1
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        st.preempted.append(req.request_id)

    @property
    def ops_in_progress(self) -> BlockOps | None:
        """The block copies of the schedule() call that raised, None between calls (fault
        recovery reads them: `service.core.fault_recovery`)."""
        return self._step.ops if self._step is not None else None

    def forget_step(self) -> None:
        self._step = None

    def check_integrity(self) -> None:
        """The pool's and swap space's invariants against every live request's blocks."""
        self.kv.check_integrity(self.running, self.waiting)
