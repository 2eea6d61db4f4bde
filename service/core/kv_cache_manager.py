"""A request's KV blocks: prefix-cache lookups, allocation with copy-on-write, swap choice.

The scheduler decides who runs; this decides which blocks they get. It owns the
device block pool (`KVBlockPool`) and the CPU swap space, and every call is
check-then-commit: running short is a return value (False), never an exception.

Preemption (PagedAttention, Kwon et al., SOSP 2023, section 4.5): a victim's
blocks are either copied to CPU swap space (swap) or dropped, its tokens to be
prefilled again (recompute). The cost model (DESIGN.md) swaps when

    kv_bytes / swap_bytes_per_s < tokens / prefill_tokens_per_s

with both rates measured at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.block_pool import KVBlockPool
from service.core.disk_prefix import DiskPrefix
from service.core.kv_disk import DiskTier
from service.core.request import Request, RequestStatus
from service.core.swap_space import SwapSpace


@dataclass(frozen=True)
class PreemptionCost:
    """Rates measured at start-up for the swap-or-recompute choice (DESIGN.md)."""

    kv_bytes_per_block: int
    swap_bytes_per_s: float
    prefill_tokens_per_s: float

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap_s = num_blocks * self.kv_bytes_per_block / self.swap_bytes_per_s
        return swap_s < num_tokens / self.prefill_tokens_per_s


@dataclass
class BlockOps:
    """Block copies one step needs before its forward (see SchedulerOutput)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    """Blocks of every live request.

    Args:
        pool: the device block pool. swap: CPU swap space, None disables swapping.
        preemption_mode: "swap", "recompute" or "auto" (the cost model decides).
        cost: measured rates for "auto" (recompute when None).
        disk: the disk KV tier (`service.core.kv_disk`), None when off; it needs prefix
            caching (without it no block is ever saved or loaded).
    """

    def __init__(self, pool: KVBlockPool, swap: SwapSpace | None, preemption_mode: str,
                 cost: PreemptionCost | None, disk: DiskTier | None = None) -> None:
        self.pool = pool
        self.swap = swap
        self.preemption_mode = preemption_mode
        self.cost = cost
        self.block_size = pool.block_size
        self.disk: DiskPrefix | None = (DiskPrefix(disk, pool)
                                        if disk is not None and pool.enable_prefix_caching
                                        else None)

    # ---- starting and growing --------------------------------------------------------
    def start(self, req: Request, budget: int, max_usage: float | None) -> bool:
        """Blocks for a new or recompute-preempted request's first chunk (prefix hits
        reused): at most `budget` new tokens. max_usage: refuse when usage would exceed
        it afterwards (None: no cap). False, nothing taken, when the pool is short."""
        tokens = req.all_token_ids
        cached = self._cached_prefix(req, tokens)
        num_cached = len(cached) * self.block_size
        n = min(len(tokens) - num_cached, budget)
        need = self.pool.blocks_needed(num_cached + n) - len(cached)
        if not self.pool.can_allocate(need, cached):
            return False
        if max_usage is not None and \
                not self._fits(need + self.pool.num_reclaimable(cached), max_usage):
            return False
        self.pool.take_cached(cached)
        req.block_ids = cached + self.pool.allocate(need)
        req.num_computed_tokens = num_cached
        req.num_registered_blocks = len(cached)
        disk_tokens = 0
        if req.disk_block_range is not None:  # blocks the disk tier just loaded
            lo, hi = req.disk_block_range
            disk_tokens = max(0, min(len(cached), hi) - lo) * self.block_size
            req.disk_block_range = None
        self.pool.record_prefix_query(len(tokens), num_cached, disk_tokens)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
            req.num_disk_cached_tokens = disk_tokens
        return True

    def swap_in(self, req: Request, budget: int, max_usage: float | None, ops: BlockOps) -> bool:
        """Device blocks for a swapped-out request: its CPU blocks come back first."""
        assert self.swap is not None
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        need = max(self.pool.blocks_needed(req.num_computed_tokens + n), len(req.cpu_block_ids))
        if not self.pool.can_allocate(need) or \
                (max_usage is not None and not self._fits(need, max_usage)):
            return False
        blocks = self.pool.allocate(need)
        ops.swap_in.extend(zip(req.cpu_block_ids, blocks))
        self.swap.free(req.cpu_block_ids)
        req.cpu_block_ids = []
        req.block_ids = blocks
        req.num_registered_blocks = 0  # re-register full blocks under their hashes
        return True

    def _fits(self, need: int, max_usage: float) -> bool:
        after = 1.0 - (self.pool.num_free_blocks - need) / self.pool.num_blocks
        return after <= max_usage

    def allocate(self, req: Request, n: int, ops: BlockOps) -> bool:
        """Give `req` blocks for n more tokens; False (nothing taken) when the pool is short.

        Copy-on-write: if the partly filled block that the first new token goes into is
        shared (ref count > 1), the request gets a private copy first. By construction
        the prefix cache shares only full blocks, which are never written again, so this
        guards forks of a sequence (e.g. parallel sampling) rather than prefix hits.
        """
        bs = self.block_size
        start = req.num_computed_tokens
        cow = start % bs != 0 and self.pool.ref_count(req.block_ids[start // bs]) > 1
        need = -(-(start + n) // bs) - len(req.block_ids) + cow
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if not blocks:
            return False
        if cow:
            i = start // bs
            ops.copies.append((req.block_ids[i], blocks[0]))
            self.pool.free([req.block_ids[i]])
            req.block_ids[i] = blocks.pop(0)
        req.block_ids.extend(blocks)
        return True

    def owns_next_slot(self, req: Request) -> bool:
        """Whether the slot of req's next token is in a block it holds alone (a decode then
        needs no allocation and no copy: the scheduler's fast path)."""
        start = req.num_computed_tokens
        bs = self.block_size
        return start < len(req.block_ids) * bs and (
            start % bs == 0 or self.pool.ref_count(req.block_ids[start // bs]) == 1)

    # ---- preemption and finishing ----------------------------------------------------
    def preempt(self, req: Request, ops: BlockOps) -> bool:
        """Swap `req` out to CPU (True) or drop its blocks for recompute (False)."""
        cpu = self.swap.allocate(len(req.block_ids)) \
            if self.swap is not None and self._swap_chosen(req) else []
        if cpu:
            ops.swap_out.extend(zip(req.block_ids, cpu))
            req.cpu_block_ids = cpu
            req.status = RequestStatus.SWAPPED
        else:
            if self.disk is not None:  # its KV may come back from disk on resume
                self.disk.note_blocks(req)
                self.disk.flush()  # now: this schedule() may reuse the blocks at once
                req.disk_checked = False
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        return bool(cpu)

    def _swap_chosen(self, req: Request) -> bool:
        mode = self.preemption_mode
        if self.swap is None or self.swap.num_blocks == 0 or mode == "recompute":
            return False
        if mode == "swap":
            return True
        return self.cost is not None and self.cost.prefer_swap(len(req.block_ids),
                                                               req.num_computed_tokens)

    def free(self, req: Request, save: bool = False) -> None:
        """Return every device and CPU block of `req`. save: note its computed full blocks
        for the disk tier first (a request that ended well; never one that failed, whose
        last chunk's K/V may not have been written)."""
        if self.disk is not None:
            self.disk.forget(req)
            if save:
                self.disk.note_blocks(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        if req.cpu_block_ids:
            assert self.swap is not None
            self.swap.free(req.cpu_block_ids)
            req.cpu_block_ids = []

    # ---- prefix cache ----------------------------------------------------------------
    def _cached_prefix(self, req: Request, tokens: list[int]) -> list[int]:
        # prompt logprobs need every prompt position computed (vLLM skips the cache too),
        # until the first token came (a recompute after that may hit)
        if not self.pool.enable_prefix_caching or (
                req.params.prompt_logprobs is not None and not req.output_token_ids):
            return []
        return self.pool.find_cached_prefix(tokens, self.full_block_hashes(req, tokens))

    def full_block_hashes(self, req: Request, tokens: list[int]) -> list[int]:
        """req.block_hashes extended over every full block of `tokens` (its tokens)."""
        self._extend_hashes(req, tokens, len(tokens) // self.block_size)
        return req.block_hashes

    def _extend_hashes(self, req: Request, tokens: list[int], num_full: int) -> None:
        have = len(req.block_hashes)
        if num_full > have:
            parent = req.block_hashes[-1] if have else None
            req.block_hashes.extend(
                self.pool.block_hashes(tokens[:num_full * self.block_size], have, parent))

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that the last step filled under their chained hashes."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = req.num_computed_tokens // bs
        if num_full <= req.num_registered_blocks:
            return
        tokens = req.all_token_ids
        self._extend_hashes(req, tokens, num_full)
        for b in range(req.num_registered_blocks, num_full):
            self.pool.cache_block(req.block_ids[b], req.block_hashes[b],
                                  tokens[b * bs:(b + 1) * bs])
        req.num_registered_blocks = num_full

    def check_integrity(self, running: list[Request], waiting: list[Request]) -> None:
        """The pool's and swap space's invariants against every live request's blocks."""
        self.pool.check_integrity([r.block_ids for r in running])
        for r in waiting:
            assert not r.block_ids, f"waiting request {r.request_id} holds blocks {r.block_ids}"
            assert bool(r.cpu_block_ids) == (r.status is RequestStatus.SWAPPED), (
                f"request {r.request_id} is {r.status} with CPU blocks {r.cpu_block_ids}")
        if self.swap is not None:
            self.swap.check_integrity([r.cpu_block_ids for r in waiting])
