"""The disk tier as the scheduler sees it: read-ahead of prefix blocks and write-behind
of finished requests' blocks (pure and synchronous; the tier does the I/O off-thread).

Read-ahead, for a waiting request (new, or preempted for recompute), once:

    prompt blocks  [ pool hit: 0..p | on disk: p..p+k | computed: p+k.. ]
    1. start_loads(): p = the pool's cached prefix, k = the disk's leading hits after it
       (never the block holding the last prompt token: one token is always computed);
       the tier reads the k blocks in its loader thread; the request waits, others run.
    2. poll() (a later schedule()): k' <= k blocks were read and verified; k' fresh pool
       blocks are allocated, filled (`DiskTier.install`), registered in the prefix cache
       under the request's chained hashes and freed again (cached-free, MRU end).
    3. The request starts as usual (`KVCacheManager.start`): its pool prefix now spans
       p + k' blocks; only the rest is prefilled.
A load that fails (a bad or missing file) stops at that block: the rest is computed.
If the pool evicted some of blocks 0..p meanwhile, the load is dropped and the request
is looked up again from its shorter pool hit. A hit is confirmed token by token in the
pool as always: at worst a smaller hit, never wrong KV.

Write-behind (write-through, as SGLang HiCache's default policy), a request's computed
full blocks are noted
- when its prompt is done (its first token sampled),
- every DECODE_NOTE_BLOCKS new full blocks while it decodes (a long-running request),
- when it ends, and when it is preempted for recompute: with the tier, a preemption
  that finds `--swap-space` full (or chooses recompute) spills its KV to disk, and its
  resume reads the full blocks back (only the last, partly filled block is recomputed);
`flush()` hands them to `DiskTier.save` before the next allocation can reuse their
blocks (end of step() and start of schedule()), which copies their K/V out at once and
writes them behind. A save the write queue could not take (dropped, counted) gets a
second chance when the pool evicts the block: the pool's `on_evict` hook offers every
noted block again just before its K/V is overwritten (`DiskTier.save(evicting=True)`;
blocks the tier holds are skipped).
"""

from __future__ import annotations

from service.core.block_pool import KVBlockPool
from service.core.kv_digest import block_digests
from service.core.kv_disk import DiskBlock, DiskTier
from service.core.request import Request, RequestStatus

__all__ = ["DECODE_NOTE_BLOCKS", "DiskPrefix"]

DECODE_NOTE_BLOCKS = 8  # a decoding request's new full blocks are saved in groups of this


class DiskPrefix:
    """Args:
        tier: the disk tier. pool: the device block pool.
        max_loads: most requests loading at once (each holds a staging copy).
    """

    def __init__(self, tier: DiskTier, pool: KVBlockPool, max_loads: int = 4) -> None:
        self.tier = tier
        self.pool = pool
        self.max_loads = max_loads
        self.block_size = pool.block_size
        self.loading: dict[str, tuple[Request, int]] = {}  # request id -> (request, p)
        self._pending: list[DiskBlock] = []
        # pool block id -> (its pool hash, the block as noted): what the pool's eviction
        # hook offers the tier again (at most one entry per pool block)
        self._noted: dict[int, tuple[int, DiskBlock]] = {}
        pool.on_evict = self._on_evict
        self.num_loaded_blocks = 0     # installed in the pool
        self.num_unplaced_blocks = 0   # read, but no free pool block to put them in

    # ---- digests -----------------------------------------------------------------------
    def digests(self, req: Request, num_full: int) -> list[bytes]:
        """req.disk_digests extended to its first `num_full` full blocks."""
        have = len(req.disk_digests)
        if num_full > have:
            tokens = req.token_slice(0, num_full * self.block_size)
            parent = req.disk_digests[-1] if have else None
            req.disk_digests.extend(block_digests(self.tier.root, tokens, self.block_size,
                                                  have, parent))
        return req.disk_digests

    # ---- read-ahead ----------------------------------------------------------------------
    def start_loads(self, candidates: list[Request], pool_hashes) -> None:
        """Look the first not-yet-checked candidates up on disk and queue their loads.

        pool_hashes(req, tokens) -> req.block_hashes extended over its full blocks (the
        KVCacheManager's). Each request is checked once per wait (a preemption resets it).
        """
        if not self.tier.enabled:
            return
        bs = self.block_size
        for req in candidates:
            if len(self.loading) >= self.max_loads:
                return
            if req.disk_checked or req.status not in (RequestStatus.WAITING,
                                                      RequestStatus.PREEMPTED):
                continue
            req.disk_checked = True
            if req.params.prompt_logprobs is not None and not req.output_token_ids:
                continue  # its prompt is scored from token 0: no cached prefix is used
            tokens = req.all_token_ids
            limit = (len(tokens) - 1) // bs  # the last token's block is always computed
            if limit == 0:
                continue
            hashes = pool_hashes(req, tokens)
            p = len(self.pool.find_cached_prefix(tokens, hashes))
            if p >= limit:
                continue
            digests = self.digests(req, limit)
            k = self.tier.lookup(digests[p:limit])
            if k == 0:
                continue
            expected = [tuple(tokens[b * bs:(b + 1) * bs]) for b in range(p, p + k)]
            if self.tier.load(req.request_id, digests[p:p + k], expected):
                req.disk_loading = True
                self.loading[req.request_id] = (req, p)

    def poll(self, max_usage: float = 1.0) -> None:
        """Put finished loads into pool blocks (see the module docstring, step 2), unless
        that would push pool usage over `max_usage` (0..1; then the load is dropped)."""
        for result in self.tier.poll():
            entry = self.loading.pop(result.key, None)
            if entry is None:
                self.tier.discard(result)
                continue
            req, p = entry
            req.disk_loading = False
            k = result.num_blocks
            if k == 0 or req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.tier.discard(result)
                continue
            tokens = req.all_token_ids
            prefix = self.pool.find_cached_prefix(tokens, req.block_hashes)
            if len(prefix) < p:
                # the pool evicted some of blocks 0..p meanwhile: the chain would break
                # there, so look again (the next lookup starts at the shorter pool hit, and
                # the gap can only shrink to 0: at most p retries)
                req.disk_checked = False
                self.num_unplaced_blocks += k
                self.tier.discard(result)
                continue
            prefix = prefix[:p]
            self.pool.take_cached(prefix)  # so allocating cannot evict them
            fits = self.pool.can_allocate(k) and \
                1.0 - (self.pool.num_free_blocks - k) / self.pool.num_blocks <= max_usage
            blocks = self.pool.allocate(k) if fits else []
            if not blocks:
                self.pool.free(prefix)
                self.num_unplaced_blocks += k
                self.tier.discard(result)
                continue
            self.tier.install(result, blocks)
            bs = self.block_size
            for i, b in enumerate(blocks):
                j = p + i
                self.pool.cache_block(b, req.block_hashes[j], tokens[j * bs:(j + 1) * bs])
            self.pool.free(prefix + blocks)  # cached-free; the last block is evicted first
            self.num_loaded_blocks += k
            req.disk_block_range = (p, p + k)

    def forget(self, req: Request) -> None:
        """`req` ended or left the waiting set: its load, if any, is dropped on arrival."""
        if self.loading.pop(req.request_id, None) is not None:
            req.disk_loading = False

    def has_loads(self) -> bool:
        return bool(self.loading)

    # ---- write-behind --------------------------------------------------------------------
    def note_blocks(self, req: Request, start: int = 0) -> None:
        """Remember `req`'s computed full blocks from block `start` on for the next flush
        (call before its blocks are freed: their K/V stays intact until a later
        allocation reuses them)."""
        if not self.tier.enabled or not req.block_ids:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_ids))
        if num_full <= start:
            return
        digests = self.digests(req, num_full)
        hashes = req.block_hashes
        for b in range(start, num_full):
            block = DiskBlock(digests[b], tuple(req.token_slice(b * bs, (b + 1) * bs)),
                              req.block_ids[b], digests[b - 1] if b else None)
            self._pending.append(block)
            if b < len(hashes):
                self._noted[block.block_id] = (hashes[b], block)
        req.disk_noted_blocks = max(req.disk_noted_blocks, num_full)

    def note_decoded_blocks(self, req: Request) -> None:
        """While `req` decodes: note its new full blocks once DECODE_NOTE_BLOCKS of them
        have been computed since the last note."""
        if req.num_computed_tokens // self.block_size >= \
                req.disk_noted_blocks + DECODE_NOTE_BLOCKS:
            self.note_blocks(req, req.disk_noted_blocks)

    def _on_evict(self, evicted: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """The pool is about to reuse these cached blocks: offer the tier those noted
        under the same hash and tokens (a block id reused since it was noted is not
        offered: its K/V is another block's now)."""
        again = []
        for block_id, block_hash, token_ids in evicted:
            entry = self._noted.pop(block_id, None)
            if entry is not None and entry[0] == block_hash and \
                    entry[1].token_ids == token_ids:
                again.append(entry[1])
        if again and self.tier.enabled:
            self.flush()
            self.tier.save(again, evicting=True)

    def flush(self) -> None:
        """Hand the noted blocks to the tier (it copies their K/V out now)."""
        if self._pending:
            pending, self._pending = self._pending, []
            if self.tier.enabled:
                self.tier.save(pending)
