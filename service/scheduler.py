"""Continuous batching scheduler (iteration-level scheduling, Orca, OSDI 2022).

Before every forward the batch is rebuilt: finished requests have already left,
running requests get their next token(s), waiting requests fill what is left of
the token budget (`max_num_batched_tokens`) and sequence cap (`max_num_seqs`).
Prefill is chunked: a long prompt takes several steps, mixed with other
sequences' decodes. Preemption is by recompute: the victim's blocks are freed
and it goes back to the front of the waiting queue (vLLM's recompute mode).

Policy here is FCFS: waiting requests are admitted in arrival order and the
newest running request is the preemption victim. A request is never preempted
forever: a preempted request goes to the FRONT of the waiting queue, and the
admission check guarantees that any single request fits the whole pool, so once
the requests ahead of it finish it runs alone at worst.
"""

from __future__ import annotations

import time
from collections import deque

from service.block_pool import KVBlockPool
from service.config import SchedulerConfig
from service.request import Request, RequestStatus
from service.scheduler_output import ScheduledSequence, SchedulerOutput


class Scheduler:
    """Owns the waiting and running sets and the KV block pool (sync, no I/O).

    Args:
        config: token budget and sequence cap.
        pool: the KV block pool (only this object calls it).
        max_model_len: context cap in tokens.
    """

    def __init__(self, config: SchedulerConfig, pool: KVBlockPool, max_model_len: int) -> None:
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- membership ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """End a request (stop, length, cancelled, error): free its blocks, drop it.

        Returns the request, or None when the id is unknown or already finished.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

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
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSequence] = []
        scheduled: set[str] = set()
        preempted: list[str] = []

        # 1) running requests: decodes first, then unfinished prefill chunks
        def remaining(r: Request) -> int:
            return r.num_tokens - r.num_computed_tokens

        order = sorted(self.running, key=lambda r: remaining(r) > 1)  # stable
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(remaining(req), budget)
            while not self._allocate(req, n):
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                out.append(self._scheduled(req, n))
                scheduled.add(req.request_id)
                budget -= n

        # 2) waiting requests, in order, unless this step had to preempt
        while not preempted and self.waiting and budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            cached = self._cached_prefix(req, tokens)
            num_cached = len(cached) * self.pool.block_size
            n = min(len(tokens) - num_cached, budget)
            need = self.pool.blocks_needed(num_cached + n) - len(cached)
            if not self.pool.can_allocate(need, cached):
                break
            self.pool.take_cached(cached)
            req.block_ids = cached + self.pool.allocate(need)
            req.num_computed_tokens = num_cached
            req.num_registered_blocks = len(cached)
            self.pool.record_prefix_query(len(tokens), num_cached)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append(self._scheduled(req, n))
            budget -= n

        return SchedulerOutput(out, self.config.max_num_batched_tokens - budget, preempted)

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advance each scheduled request by its computed tokens, append sampled tokens.

        Returns the requests that got a new token (in schedule order). Full blocks
        computed this step enter the prefix cache. Requests finished meanwhile (a
        cancel that raced the step) are skipped.
        """
        got: list[Request] = []
        for seq in output.sequences:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += len(seq.token_ids)
            self._cache_full_blocks(req)
            token = sampled.get(seq.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                got.append(req)
        return got

    # ---- helpers -------------------------------------------------------------------
    def _scheduled(self, req: Request, n: int) -> ScheduledSequence:
        start = req.num_computed_tokens
        return ScheduledSequence(
            request_id=req.request_id,
            token_ids=req.token_slice(start, start + n),
            num_computed_tokens=start,
            block_table=list(req.block_ids),
            sample=start + n == req.num_tokens,
            params=req.params,
            generator=req.generator,
        )

    def _allocate(self, req: Request, n: int) -> bool:
        """Give `req` blocks for n more tokens; False (nothing taken) when the pool is short."""
        need = self.pool.blocks_needed(req.num_computed_tokens + n) - len(req.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if not blocks:
            return False
        req.block_ids.extend(blocks)
        return True

    def _pick_victim(self, scheduled: set[str]) -> Request:
        """FCFS: the most recently arrived running request not yet in this step."""
        candidates = [r for r in self.running if r.request_id not in scheduled]
        assert candidates, "no preemption candidate: the current request is always one"
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue."""
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

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
        """The pool's invariants against every live request's block table."""
        self.pool.check_integrity([r.block_ids for r in self.running])
        for r in self.waiting:
            assert not r.block_ids, f"waiting request {r.request_id} holds blocks {r.block_ids}"
