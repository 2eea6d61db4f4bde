"""Exact-id unit tests of the KV block pool (no model)."""

from __future__ import annotations

import pytest

from service.core.block_pool import KVBlockPool


def test_allocate_order_and_free_tail_first():
    pool = KVBlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(5 / 6)
    pool.check_integrity([a, b])
    pool.free(b)  # tail-first: 4, 3, 2 join the free queue in that order
    assert list(pool._free) == [5, 4, 3, 2]
    assert pool.allocate(2) == [5, 4]
    pool.check_integrity([a, [5, 4]])


def test_allocate_more_than_free_takes_nothing():
    pool = KVBlockPool(3, 4)
    held = pool.allocate(2)
    assert pool.allocate(2) == []
    assert not pool.can_allocate(2)
    assert pool.can_allocate(1)
    pool.check_integrity([held])


def _fill(pool: KVBlockPool, tokens: list[int]) -> list[int]:
    """Allocate and register every full block of `tokens` as if it was computed."""
    blocks = pool.allocate(pool.blocks_needed(len(tokens)))
    hashes = pool.block_hashes(tokens)
    for b, h in enumerate(hashes):
        bs = pool.block_size
        pool.cache_block(blocks[b], h, tokens[b * bs:(b + 1) * bs])
    return blocks


def test_prefix_hit_revives_free_cached_blocks_and_counts_refs():
    pool = KVBlockPool(8, 4)
    tokens = list(range(10))           # 2 full blocks + 2 tokens
    first = _fill(pool, tokens)        # blocks 0, 1, 2
    assert first == [0, 1, 2]
    hit = pool.find_cached_prefix(tokens, pool.block_hashes(tokens))
    assert hit == [0, 1]
    pool.take_cached(hit)              # shared while the first request still runs
    assert [pool.blocks[b].ref_cnt for b in (0, 1, 2)] == [2, 2, 1]
    pool.check_integrity([first, hit])
    pool.free(first)
    pool.free(hit)
    assert list(pool._free)[-3:] == [2, 1, 0]
    # a later request with the same prefix revives them from the free queue
    again = pool.find_cached_prefix(tokens, pool.block_hashes(tokens))
    assert again == [0, 1] and pool.num_reclaimable(again) == 2
    pool.take_cached(again)
    pool.check_integrity([again])


def test_at_least_one_token_is_computed():
    pool = KVBlockPool(8, 4)
    tokens = list(range(8))            # exactly 2 full blocks
    blocks = _fill(pool, tokens)
    # matching both blocks would leave nothing to compute: only the first may hit
    assert pool.find_cached_prefix(tokens, pool.block_hashes(tokens)) == [0]
    pool.free(blocks)


def test_hash_chain_same_tokens_after_other_parent_do_not_hit():
    pool = KVBlockPool(8, 4)
    blocks = _fill(pool, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    other = [9, 9, 9, 9, 5, 6, 7, 8, 0]  # block 1 has the same tokens, other parent
    assert pool.find_cached_prefix(other, pool.block_hashes(other)) == []
    pool.free(blocks)
    pool.check_integrity()


def test_forced_hash_collision_does_not_hit():
    pool = KVBlockPool(8, 4, hash_fn=lambda parent, toks: 42)  # every block collides
    blocks = _fill(pool, [1, 2, 3, 4, 0])
    other = [5, 6, 7, 8, 0]
    assert pool.find_cached_prefix(other, pool.block_hashes(other)) == []
    same = [1, 2, 3, 4, 0]
    assert pool.find_cached_prefix(same, pool.block_hashes(same)) == [blocks[0]]
    pool.free(blocks)
    pool.check_integrity()


def test_lru_eviction_order():
    pool = KVBlockPool(4, 2)
    a = _fill(pool, [1, 2, 3, 4, 0])     # blocks 0, 1, 2 (0 and 1 cached)
    pool.free(a)                         # free queue: 3, 2, 1, 0
    assert list(pool._free) == [3, 2, 1, 0]
    assert pool.allocate(2) == [3, 2]    # never-used first, then the tail block
    assert pool.blocks[1].block_hash is not None
    assert pool.allocate(1) == [1]       # evicts cached block 1 (a's second block)
    assert pool.blocks[1].block_hash is None and pool.stats.evictions == 1
    tokens = [1, 2, 3, 4, 0]
    assert pool.find_cached_prefix(tokens, pool.block_hashes(tokens)) == [0]
    pool.check_integrity([[3], [2], [1]])


def test_disabled_prefix_caching_never_hits():
    pool = KVBlockPool(8, 4, enable_prefix_caching=False)
    tokens = list(range(9))
    blocks = _fill(pool, tokens)
    assert pool.find_cached_prefix(tokens, pool.block_hashes(tokens)) == []
    pool.free(blocks)
    pool.check_integrity()


def test_integrity_detects_leak():
    pool = KVBlockPool(4, 4)
    held = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity([])
    pool.free(held)
    pool.check_integrity([])
