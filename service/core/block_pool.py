"""KV block pool: fixed-size blocks, ref counts, automatic prefix caching.

Design follows PagedAttention (Kwon et al., SOSP 2023, section 4.2) for the block
table, and vLLM v1's KV cache manager for prefix caching: a full block is keyed
by a chained hash of (parent block's hash, this block's token ids); freed blocks
that carry a hash stay in the free queue and can be revived by a later prefix hit
until allocation evicts them in LRU order.

Only the scheduler calls the pool, synchronously, with check-then-commit pairs:
running out of blocks is a return value (False / empty list), never an exception.

Free queue order (front = evicted first):

    free  [ never-used ... | LRU cached ...... MRU cached ]
    allocate() pops from the front; free_blocks() appends a request's blocks
    tail-first, so its last (least shareable) block is evicted before its first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block: depends on every token before it through `parent`."""
    return hash((parent, token_ids))


@dataclass
class Block:
    """One KV block of `block_size` token slots.

    block_hash / token_ids are set once the block is full and registered in the
    prefix cache; token_ids are kept to confirm a hash hit (no wrong KV on collision).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class PoolStats:
    """Counters the metrics read: prefix cache queries/hits are counted in tokens (as vLLM)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_disk_hits: int = 0  # of prefix_cache_hits, tokens read from the disk tier
    evictions: int = 0


class KVBlockPool:
    """Blocks `0 .. num_blocks-1`, a free queue and a hash -> block prefix cache.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block.
        enable_prefix_caching: register and look up full blocks by chained hash.
        hash_fn: block hash function (tests force collisions with it).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, Block] = {}
        self.stats = PoolStats()
        # called by allocate() with the (block id, block hash, token ids) of the cached
        # blocks it just evicted, before any K/V in them is overwritten (the disk tier's
        # last chance to save them: service.core.disk_prefix)
        self.on_evict: Callable[[list[tuple[int, int, tuple[int, ...]]]], None] | None = None

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many requests hold block `block_id` (0: free or cached-free)."""
        return self.blocks[block_id].ref_cnt

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, token_ids: Sequence[int], start: int = 0,
                     parent: int | None = None) -> list[int]:
        """Chained hashes of the full blocks of `token_ids` from block index `start`.

        `parent` is the hash of block `start - 1` (None when start == 0).
        """
        bs = self.block_size
        out: list[int] = []
        for b in range(start, len(token_ids) // bs):
            parent = self.hash_fn(parent, tuple(token_ids[b * bs:(b + 1) * bs]))
            out.append(parent)
        return out

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, without taking them.

        At most `(len(token_ids) - 1) // block_size` blocks are matched, so at least one
        prompt token is always computed (its logits are needed to sample). Counts the
        query and hit in `stats` (in tokens).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        limit = min(len(hashes), (len(token_ids) - 1) // bs)
        hit: list[int] = []
        for b in range(limit):
            block = self._cached.get(hashes[b])
            if block is None or block.token_ids != tuple(token_ids[b * bs:(b + 1) * bs]):
                break  # a miss, or a hash collision with other tokens: never serve wrong KV
            hit.append(block.block_id)
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int,
                            num_disk_hit_tokens: int = 0) -> None:
        """Count one admitted request's prefix lookup (tokens queried, tokens hit, and of
        those the tokens whose blocks the disk tier had just loaded)."""
        if self.enable_prefix_caching:
            self.stats.prefix_cache_queries += num_tokens
            self.stats.prefix_cache_hits += num_hit_tokens
            self.stats.prefix_cache_disk_hits += num_disk_hit_tokens

    def num_reclaimable(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` (a cached prefix) sit in the free queue right now."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    # ---- check-then-commit ----------------------------------------------------
    def can_allocate(self, num_new_blocks: int, cached_blocks: Sequence[int] = ()) -> bool:
        """True when `num_new_blocks` fresh blocks fit after reviving `cached_blocks`."""
        return num_new_blocks + self.num_reclaimable(cached_blocks) <= len(self._free)

    def take_cached(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block of a cached prefix (reviving free ones)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self._free[b]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh blocks from the front of the free queue.

        Returns [] (and takes nothing) when fewer are free; a cached-free block that is
        taken leaves the prefix cache (LRU eviction).
        """
        if num_blocks > len(self._free):
            return []
        out: list[int] = []
        evicted: list[tuple[int, int, tuple[int, ...]]] = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            block = self.blocks[b]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if self.on_evict is not None:
                        evicted.append((b, block.block_hash, block.token_ids))
                block.block_hash = block.token_ids = None
                self.stats.evictions += 1
            block.ref_cnt = 1
            out.append(b)
        if evicted:
            self.on_evict(evicted)
        return out

    def cache_block(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a block that just became full under its chained hash.

        If another block already holds that hash, the first one stays the cached copy
        (both hold the same KV); this one is freed normally later.
        """
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"caching free block {block_id}"
        assert len(token_ids) == self.block_size, "only full blocks are cached"
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        `block_ids` is a request's block table in order; it is walked tail-first so
        the request's last blocks are evicted before its (more shareable) first ones.
        """
        for b in reversed(block_ids):
            block = self.blocks[b]
            assert block.ref_cnt > 0, f"double free of block {b}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block's hash (held blocks keep theirs)."""
        for h, block in list(self._cached.items()):
            if block.ref_cnt == 0:
                del self._cached[h]
                block.block_hash = block.token_ids = None

    # ---- invariants -------------------------------------------------------------
    def check_integrity(self, block_tables: Sequence[Sequence[int]] = ()) -> None:
        """Assert the pool's invariants against the live requests' block tables.

        free + held == total; every ref count equals the number of block tables that
        hold the block; free blocks have ref 0; cached blocks are indexed by their hash.
        Raises AssertionError with the first broken invariant.
        """
        refs = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} holders")
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {in_free}")
        held = sum(1 for r in refs if r > 0)
        assert held + len(self._free) == self.num_blocks, (
            f"{held} held + {len(self._free)} free != {self.num_blocks}")
        for h, block in self._cached.items():
            assert block.block_hash == h, f"cache entry {h} points at block {block.block_id}"
