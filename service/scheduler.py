"""Continuous batching scheduler (iteration-level scheduling, Orca, OSDI 2022).

Before every forward the batch is rebuilt: finished requests have already left,
running requests get their next token(s), waiting requests fill what is left of
the token budget (`max_num_batched_tokens`) and sequence cap (`max_num_seqs`).
Prefill is chunked: a long prompt takes several steps, mixed with other
sequences' decodes.

KV pressure (DESIGN.md, "Actors"):
- above `kv_watermark_high` no new request starts; admission reopens below
  `kv_watermark_low` (hysteresis, so admission does not flap at one level);
- above `kv_watermark_critical` running requests are preempted until usage is
  back under it (at least one keeps running);
- when a running request needs a block and none is free, the policy's victim is
  preempted, by swap (its blocks copied to CPU swap space) or by recompute (its
  blocks dropped, its tokens prefilled again), as `preemption_mode` and the cost
  model say (vLLM's two preemption modes, PagedAttention SOSP 2023, section 4.5).

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
from dataclasses import dataclass

from service.block_pool import KVBlockPool
from service.config import CacheConfig, SchedulerConfig
from service.policy import Policy, make_policy
from service.request import Request, RequestStatus
from service.scheduler_output import ScheduledSequence, SchedulerOutput
from service.swap_space import SwapSpace

_RESUMABLE = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


@dataclass(frozen=True)
class PreemptionCost:
    """Rates measured at start-up for the swap-or-recompute choice (DESIGN.md):

    swap when kv_bytes / swap_bytes_per_s < tokens / prefill_tokens_per_s.
    """

    kv_bytes_per_block: int
    swap_bytes_per_s: float
    prefill_tokens_per_s: float

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap_s = num_blocks * self.kv_bytes_per_block / self.swap_bytes_per_s
        return swap_s < num_tokens / self.prefill_tokens_per_s


@dataclass
class _Step:
    """Scratch state of one schedule() call."""

    budget: int
    sequences: list[ScheduledSequence]
    scheduled: set[str]
    preempted: list[str]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    short_of_blocks: bool = False  # a preemption freed blocks: admit nothing new this step


class Scheduler:
    """Owns the waiting and running sets, the KV block pool and the swap space (sync, no I/O).

    Args:
        config: token budget, sequence cap, preemption mode, policy.
        pool: the KV block pool (only this object calls it).
        max_model_len: context cap in tokens.
        cache: watermarks (kv_watermark_high / low / critical).
        swap: CPU swap space; None disables swapping.
        cost: measured rates for preemption_mode "auto" (recompute when None).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, config: SchedulerConfig, pool: KVBlockPool, max_model_len: int, *,
                 cache: CacheConfig | None = None, swap: SwapSpace | None = None,
                 cost: PreemptionCost | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.cache = cache or CacheConfig()
        self.swap = swap
        self.cost = cost
        self.clock = clock
        self.policy: Policy = make_policy(config.scheduling_policy, config.policy,
                                          cost.prefill_tokens_per_s if cost else None)
        self.batch: set[str] = set()  # static/dynamic batching: the batch in flight
        self.num_schedule_calls = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admitting = True  # watermark hysteresis state
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputes = 0

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
        self.pool.free(req.block_ids)
        req.block_ids = []
        if req.cpu_block_ids:
            assert self.swap is not None
            self.swap.free(req.cpu_block_ids)
            req.cpu_block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.batch.discard(request_id)
        self.policy.on_finish(req)
        return req

    @property
    def batch_in_flight(self) -> bool:
        """Static/dynamic batching: True while members of the current batch are unfinished."""
        return bool(self.batch)

    def idle_until(self) -> float | None:
        """When an empty step could turn non-empty without new input (a dynamic batch's
        queue delay running out), in clock seconds; None when only new input can."""
        if self.config.batching != "dynamic" or self.batch or not self.waiting:
            return None
        oldest = min(r.arrival_time for r in self.waiting)
        return oldest + self.config.max_queue_delay_ms / 1000.0

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
        st = _Step(self.config.max_num_batched_tokens, [], set(), [], [], [], [])
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
            if candidates:
                self._schedule_waiting(candidates, st, now)
        self.num_schedule_calls += 1
        return SchedulerOutput(st.sequences, self.config.max_num_batched_tokens - st.budget,
                               st.preempted, st.swap_out, st.swap_in, st.copies)

    def _relieve_critical(self, st: _Step, now: float) -> None:
        while self.pool.usage > self.cache.kv_watermark_critical and len(self.running) > 1:
            self._preempt(self._pick_victim(st, now), st)
            st.short_of_blocks = True

    def _admission_candidates(self, now: float) -> list[Request]:
        """Waiting requests that may start this step, in the policy's order.

        continuous: all of them, every `schedule_interval` steps (and whenever nothing
        runs). static: a batch of up to max_num_seqs forms when the previous batch has
        finished; only its members start. dynamic: like static, but the batch forms only
        once max_num_seqs requests wait or the oldest has waited max_queue_delay_ms.
        """
        if not self.waiting:
            return []
        order = sorted(self.waiting, key=lambda r: self.policy.waiting_key(r, now))
        mode = self.config.batching
        if mode == "continuous":
            if self.running and self.num_schedule_calls % self.config.schedule_interval:
                return []
            return order
        if not self.batch:
            due = self.idle_until()
            if mode == "dynamic" and len(self.waiting) < self.config.max_num_seqs \
                    and due is not None and now < due:
                return []
            self.batch = {r.request_id for r in order[:self.config.max_num_seqs]}
        return [r for r in order if r.request_id in self.batch]

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

    def _schedule_running(self, st: _Step, now: float) -> None:
        decodes, chunks = [], []
        for r in self.running:
            (decodes if len(r.prompt_token_ids) + len(r.output_token_ids)
             - r.num_computed_tokens == 1 else chunks).append(r)
        bs = self.pool.block_size
        blocks = self.pool.blocks
        running = RequestStatus.RUNNING
        for req in decodes + chunks:  # decodes first
            if st.budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            start = req.num_computed_tokens
            if start < len(req.block_ids) * bs and (
                    start % bs == 0 or blocks[req.block_ids[start // bs]].ref_cnt == 1) and \
                    start + 1 == len(req.prompt_token_ids) + len(req.output_token_ids):
                # Fast path, every step of every decode: its slot is in a block it owns
                # alone, so nothing to allocate or copy (what _allocate and _emit would
                # conclude, without their calls; measured by service.bench.scheduler_overhead).
                last = req.output_token_ids[-1] if req.output_token_ids else \
                    req.prompt_token_ids[-1]
                st.sequences.append(ScheduledSequence(req.request_id, [last], start,
                                                      req.block_ids, True, req.params,
                                                      req.generator))
                st.scheduled.add(req.request_id)
                st.budget -= 1
                continue
            n = min(len(req.prompt_token_ids) + len(req.output_token_ids)
                    - req.num_computed_tokens, st.budget)
            while not self._allocate(req, n, st):
                victim = self._pick_victim(st, now)
                self._preempt(victim, st)
                st.short_of_blocks = True
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self._emit(req, n, st)

    def _schedule_waiting(self, order: list[Request], st: _Step, now: float) -> None:
        for req in order:
            if st.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.status is RequestStatus.WAITING and not self.admitting:
                return  # above the high watermark: no new prefill until below the low one
            if req.status is RequestStatus.SWAPPED:
                ok = self._swap_in(req, st)
            else:
                ok = self._start(req, st)
            if not ok:
                return  # head-of-line: keep the policy's order
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._emit(req, min(req.num_tokens - req.num_computed_tokens, st.budget), st)

    def _fits_resume(self, need: int) -> bool:
        """A resumed request may not push usage over the high watermark (unless it runs
        alone), so critical-watermark preemption cannot thrash with resumption."""
        if not self.running:
            return True
        after = 1.0 - (self.pool.num_free_blocks - need) / self.pool.num_blocks
        return after <= self.cache.kv_watermark_high

    def _start(self, req: Request, st: _Step) -> bool:
        """Blocks for a new or recompute-preempted request's first chunk (prefix hits reused)."""
        tokens = req.all_token_ids
        cached = self._cached_prefix(req, tokens)
        num_cached = len(cached) * self.pool.block_size
        n = min(len(tokens) - num_cached, st.budget)
        need = self.pool.blocks_needed(num_cached + n) - len(cached)
        if not self.pool.can_allocate(need, cached):
            return False
        if req.status is RequestStatus.PREEMPTED and \
                not self._fits_resume(need + self.pool.num_reclaimable(cached)):
            return False
        self.pool.take_cached(cached)
        req.block_ids = cached + self.pool.allocate(need)
        req.num_computed_tokens = num_cached
        req.num_registered_blocks = len(cached)
        self.pool.record_prefix_query(len(tokens), num_cached)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        return True

    def _swap_in(self, req: Request, st: _Step) -> bool:
        """Device blocks for a swapped-out request: its CPU blocks come back first."""
        assert self.swap is not None
        n = min(req.num_tokens - req.num_computed_tokens, st.budget)
        need = max(self.pool.blocks_needed(req.num_computed_tokens + n), len(req.cpu_block_ids))
        if not self.pool.can_allocate(need) or not self._fits_resume(need):
            return False
        blocks = self.pool.allocate(need)
        st.swap_in.extend(zip(req.cpu_block_ids, blocks))
        self.swap.free(req.cpu_block_ids)
        req.cpu_block_ids = []
        req.block_ids = blocks
        req.num_registered_blocks = 0  # re-register full blocks under their hashes
        return True

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advance each scheduled request by its computed tokens, append sampled tokens.

        Returns the requests that got a new token (in schedule order). Full blocks
        computed this step enter the prefix cache. Requests finished meanwhile (a
        cancel that raced the step) are skipped.
        """
        got: list[Request] = []
        requests, bs, running = self.requests, self.pool.block_size, RequestStatus.RUNNING
        for seq in output.sequences:
            req = requests.get(seq.request_id)
            if req is None or req.status is not running:
                continue
            req.num_computed_tokens += len(seq.token_ids)
            if req.num_computed_tokens // bs > req.num_registered_blocks:
                self._cache_full_blocks(req)
            token = sampled.get(seq.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                got.append(req)
        return got

    # ---- helpers -------------------------------------------------------------------
    def _emit(self, req: Request, n: int, st: _Step) -> None:
        start = req.num_computed_tokens
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if n == 1 and start + 1 == num_tokens:  # a decode: its last sampled token
            token_ids = [req.output_token_ids[-1] if req.output_token_ids
                         else req.prompt_token_ids[-1]]
        else:
            token_ids = req.token_slice(start, start + n)
        # positional: this runs for every sequence of every step
        st.sequences.append(ScheduledSequence(req.request_id, token_ids, start, req.block_ids,
                                              start + n == num_tokens, req.params, req.generator))
        st.scheduled.add(req.request_id)
        st.budget -= n

    def _allocate(self, req: Request, n: int, st: _Step) -> bool:
        """Give `req` blocks for n more tokens; False (nothing taken) when the pool is short.

        Copy-on-write: if the partly filled block that the first new token goes into is
        shared (ref count > 1), the request gets a private copy first. By construction
        the prefix cache shares only full blocks, which are never written again, so this
        guards forks of a sequence (e.g. parallel sampling) rather than prefix hits.
        """
        bs = self.pool.block_size
        start = req.num_computed_tokens
        cow = start % bs != 0 and self.pool.blocks[req.block_ids[start // bs]].ref_cnt > 1
        need = -(-(start + n) // bs) - len(req.block_ids) + cow
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if not blocks:
            return False
        if cow:
            i = start // bs
            st.copies.append((req.block_ids[i], blocks[0]))
            self.pool.free([req.block_ids[i]])
            req.block_ids[i] = blocks.pop(0)
        req.block_ids.extend(blocks)
        return True

    def _pick_victim(self, st: _Step, now: float) -> Request:
        """The policy's victim among running requests not yet in this step."""
        candidates = [r for r in self.running if r.request_id not in st.scheduled]
        assert candidates, "no preemption candidate: the current request is always one"
        return max(candidates, key=lambda r: self.policy.victim_key(r, now))

    def _preempt(self, req: Request, st: _Step) -> None:
        """Swap `req` out to CPU or drop its blocks for recompute; it rejoins the waiting set."""
        self.running.remove(req)
        cpu = self.swap.allocate(len(req.block_ids)) if self._swap_chosen(req) else []
        if cpu:
            assert self.swap is not None
            st.swap_out.extend(zip(req.block_ids, cpu))
            req.cpu_block_ids = cpu
            req.status = RequestStatus.SWAPPED
            self.num_swaps += 1
        else:
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.num_recomputes += 1
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        st.preempted.append(req.request_id)

    def _swap_chosen(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if self.swap is None or self.swap.num_blocks == 0 or mode == "recompute":
            return False
        if mode == "swap":
            return True
        return self.cost is not None and self.cost.prefer_swap(len(req.block_ids),
                                                               req.num_computed_tokens)

    def _cached_prefix(self, req: Request, tokens: list[int]) -> list[int]:
        if not self.pool.enable_prefix_caching:
            return []
        self._extend_hashes(req, tokens, len(tokens) // self.pool.block_size)
        return self.pool.find_cached_prefix(tokens, req.block_hashes)

    def _extend_hashes(self, req: Request, tokens: list[int], num_full: int) -> None:
        have = len(req.block_hashes)
        if num_full > have:
            parent = req.block_hashes[-1] if have else None
            req.block_hashes.extend(
                self.pool.block_hashes(tokens[:num_full * self.pool.block_size], have, parent))

    def _cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that this step filled under their chained hashes."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.pool.block_size
        num_full = req.num_computed_tokens // bs
        if num_full <= req.num_registered_blocks:
            return
        tokens = req.all_token_ids
        self._extend_hashes(req, tokens, num_full)
        for b in range(req.num_registered_blocks, num_full):
            self.pool.cache_block(req.block_ids[b], req.block_hashes[b],
                                  tokens[b * bs:(b + 1) * bs])
        req.num_registered_blocks = num_full

    def check_integrity(self) -> None:
        """The pool's and swap space's invariants against every live request's blocks."""
        self.pool.check_integrity([r.block_ids for r in self.running])
        for r in self.waiting:
            assert not r.block_ids, f"waiting request {r.request_id} holds blocks {r.block_ids}"
            assert bool(r.cpu_block_ids) == (r.status is RequestStatus.SWAPPED), (
                f"request {r.request_id} is {r.status} with CPU blocks {r.cpu_block_ids}")
        if self.swap is not None:
            self.swap.check_integrity([r.cpu_block_ids for r in self.waiting])
