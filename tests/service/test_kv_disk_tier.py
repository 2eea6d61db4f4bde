"""The disk tier's I/O (service.worker.kv_disk_tier) on small KV tensors, no model: write
behind, a restart's index, load and install, corruption, eviction, a full queue, a full
disk, and another fingerprint on the same directory."""

from __future__ import annotations

import errno
import logging
import time

import pytest
import torch

from service.core.kv_digest import block_digests
from service.core.kv_disk import DiskBlock
from service.worker.kv_disk_tier import DiskTier

L, N, BS, H, D = 3, 8, 4, 2, 5  # layers, pool blocks, block size, KV heads, head dim
FIELDS = {"model": "test", "block_size": BS}


def caches(fill: bool = True) -> list[torch.Tensor]:
    out = []
    for layer in range(L):
        t = torch.zeros(2, N, BS, H, D)
        if fill:
            t.copy_(torch.randn(2, N, BS, H, D, generator=torch.Generator().manual_seed(layer)))
        out.append(t)
    return out


def blocks_of(tier: DiskTier, tokens: list[int], block_ids: list[int],
              chained: bool = False) -> list[DiskBlock]:
    """The blocks of `tokens`; chained: each names the one before it as its parent, as the
    scheduler's saves do (else each stands alone)."""
    digests = block_digests(tier.root, tokens, BS)
    return [DiskBlock(d, tuple(tokens[i * BS:(i + 1) * BS]), b,
                      digests[i - 1] if chained and i else None)
            for i, (d, b) in enumerate(zip(digests, block_ids))]


def block_file_bytes(tmp_path) -> int:
    probe = DiskTier(tmp_path / "probe", 1 << 30, FIELDS, caches())
    probe.close()
    return probe.file_nbytes


def wait_writes(tier: DiskTier, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tier.stats.blocks_written < n:
        assert time.monotonic() < deadline, f"only {tier.stats.blocks_written} of {n} written"
        time.sleep(0.01)
    while tier._inflight_bytes:  # the job's bookkeeping ends after its last file
        time.sleep(0.01)


def wait_load(tier: DiskTier, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        done = tier.poll()
        if done:
            return done
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.01)


TOKENS = list(range(1, 4 * BS + 1))  # 4 full blocks


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path, 1 << 30, FIELDS, caches())
    yield t
    t.close()


def test_save_restart_load_install_round_trip(tmp_path, tier):
    src = tier.kv_caches
    tier.save(blocks_of(tier, TOKENS, [5, 2, 7, 1]))
    wait_writes(tier, 4)
    files = sorted(tier.dir.glob("*/*.kvb"))
    assert len(files) == 4 and all(f.stat().st_size == tier.file_nbytes for f in files)
    # saving the same blocks again writes nothing
    tier.save(blocks_of(tier, TOKENS, [5, 2, 7, 1]))
    time.sleep(0.05)
    assert tier.stats.blocks_written == 4
    tier.close()

    # "restart": a new tier over an empty cache finds the four blocks
    dst = caches(fill=False)
    again = DiskTier(tmp_path, 1 << 30, FIELDS, dst)
    try:
        digests = block_digests(again.root, TOKENS, BS)
        assert len(again.index) == 4 and again.lookup(digests) == 4
        assert again.lookup(block_digests(again.root, [9] + TOKENS[1:], BS)) == 0
        expected = [tuple(TOKENS[i * BS:(i + 1) * BS]) for i in range(3)]
        assert again.load("r", digests[:3], expected)
        (result,) = wait_load(again)
        assert result.key == "r" and result.num_blocks == 3 and result.seconds > 0
        again.install(result, [0, 6, 3])
        for layer in range(L):
            for s, d in ((5, 0), (2, 6), (7, 3)):
                assert torch.equal(dst[layer][:, d], src[layer][:, s])
            assert not dst[layer][:, 1].any()  # nothing else written
        assert again.stats.blocks_read == 3
    finally:
        again.close()


def test_corrupt_and_truncated_files_are_misses_logged_and_deleted(tmp_path, tier, caplog):
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))
    wait_writes(tier, 4)
    digests = block_digests(tier.root, TOKENS, BS)
    expected = [tuple(TOKENS[i * BS:(i + 1) * BS]) for i in range(4)]
    second, third = tier.path_of(digests[1]), tier.path_of(digests[2])
    data = bytearray(second.read_bytes())
    data[-100] ^= 0xFF  # one payload byte
    second.write_bytes(bytes(data))
    third.write_bytes(third.read_bytes()[:50])
    caplog.set_level(logging.WARNING, logger="service.worker.kv_disk_tier")
    assert tier.load("r", digests, expected)
    (result,) = wait_load(tier)
    assert result.num_blocks == 1  # stops at the first bad block: the rest is recomputed
    assert tier.stats.read_failures == {"checksum": 1}
    assert not second.exists() and "checksum" in caplog.text
    assert tier.lookup(digests) == 1
    # the truncated one, asked for directly
    assert tier.load("s", digests[2:3], expected[2:3])
    (result,) = wait_load(tier)
    assert result.num_blocks == 0 and tier.stats.read_failures["truncated"] == 1
    assert "truncated" in caplog.text and not third.exists()


def test_a_file_that_vanished_is_a_miss(tier):
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))
    wait_writes(tier, 4)
    digests = block_digests(tier.root, TOKENS, BS)
    tier.path_of(digests[0]).unlink()  # e.g. evicted by another engine on the directory
    assert tier.load("r", digests[:1], [tuple(TOKENS[:BS])])
    (result,) = wait_load(tier)
    assert result.num_blocks == 0 and tier.stats.read_failures == {"missing": 1}


def test_another_fingerprint_never_sees_the_blocks(tmp_path, tier):
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))
    wait_writes(tier, 4)
    other = DiskTier(tmp_path, 1 << 30, {**FIELDS, "block_size": 8}, caches())
    try:
        assert other.dir != tier.dir and len(other.index) == 0
        assert other.lookup(block_digests(other.root, TOKENS, BS)) == 0
        # even a file copied into its folder under its digest fails the fingerprint check
        mine = block_digests(other.root, TOKENS, BS)[0]
        target = other.path_of(mine)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(tier.path_of(block_digests(tier.root, TOKENS, BS)[0]).read_bytes())
        assert other.lookup([mine]) == 1  # right size: the index believes it ...
        assert other.load("r", [mine], [tuple(TOKENS[:BS])])
        (result,) = wait_load(other)
        assert result.num_blocks == 0 and other.stats.read_failures == {"fingerprint": 1}
    finally:
        other.close()


def test_lru_eviction_by_size_keeps_recent_blocks(tmp_path):
    # blocks that stand alone (no parents): plain LRU among them
    size = block_file_bytes(tmp_path)
    tier = DiskTier(tmp_path, 3 * size, FIELDS, caches())
    try:
        tokens = list(range(1, 6 * BS + 1))  # 6 blocks, room for 3
        digests = block_digests(tier.root, tokens, BS)
        blocks = blocks_of(tier, tokens, [0, 1, 2, 3, 4, 5])
        tier.save(blocks[:3])
        wait_writes(tier, 3)
        tier.index.touch_chain(digests[0])  # block 0 used again: 1 and 2 are older
        tier.save(blocks[3:5])
        wait_writes(tier, 5)
        assert tier.index.lru_order() == [digests[0], digests[3], digests[4]]
        assert tier.stats.blocks_evicted == 2 and tier.index.total_bytes == 3 * size
        assert sorted(p.name for p in tier.dir.glob("*/*.kvb")) == sorted(
            d.hex() + ".kvb" for d in (digests[0], digests[3], digests[4]))
    finally:
        tier.close()


def test_a_chain_longer_than_the_tier_keeps_its_head(tmp_path):
    # a sequence of 6 blocks into room for 3: the first 3 stay (a lookup hits them); the
    # last 3 are skipped, where plain LRU had evicted the head and left nothing reachable
    size = block_file_bytes(tmp_path)
    tier = DiskTier(tmp_path, 3 * size, FIELDS, caches())
    tokens = list(range(1, 6 * BS + 1))
    digests = block_digests(tier.root, tokens, BS)
    try:
        tier.save(blocks_of(tier, tokens, [0, 1, 2, 3, 4, 5], chained=True))
        wait_writes(tier, 3)
        # the last 3 never reach the write queue: their K/V is not even copied out
        assert tier.lookup(digests) == 3 and tier.stats.writes_skipped == 3
        assert tier.stats.blocks_written == 3
        tier.save(blocks_of(tier, tokens, [0, 1, 2, 3, 4, 5], chained=True))  # offered again
        assert tier.stats.writes_skipped == 3 and not tier._queued  # counted once, not queued
        assert tier.stats.blocks_evicted == 0
        assert tier.index.lru_order() == [digests[2], digests[1], digests[0]]  # head last
    finally:
        tier.close()
    again = DiskTier(tmp_path, 3 * size, FIELDS, caches())
    try:  # a restart rebuilds the same order from the files' times
        assert again.lookup(digests) == 3
        assert again.index.lru_order() == [digests[2], digests[1], digests[0]]
    finally:
        again.close()


def test_the_writer_skips_what_would_cut_its_own_sequence(tmp_path):
    # blocks saved in two calls: the second call's first block names a parent still in the
    # write queue, so only the writer can see that the sequence has outgrown the tier
    size = block_file_bytes(tmp_path)
    tier = DiskTier(tmp_path, 2 * size, FIELDS, caches())
    tokens = list(range(1, 4 * BS + 1))
    digests = block_digests(tier.root, tokens, BS)
    blocks = blocks_of(tier, tokens, [0, 1, 2, 3], chained=True)
    try:
        tier._write_q.put(None)  # stop the writer, so that both calls queue first
        tier._writer.join()
        tier.save(blocks[:2])
        tier.save(blocks[2:])
        assert tier.stats.writes_skipped == 0  # block 2's parent was queued, not indexed
        jobs = []
        while not tier._write_q.empty():
            jobs.append(tier._write_q.get())
        for job in jobs:
            tier._write(job)
        assert tier.lookup(digests) == 2 and tier.stats.writes_skipped == 2
        assert tier.stats.blocks_evicted == 0
    finally:
        tier._closed = True


def test_another_sequence_takes_its_room_from_chain_ends(tmp_path):
    size = block_file_bytes(tmp_path)
    tier = DiskTier(tmp_path, 4 * size, FIELDS, caches())
    a_tokens, b_tokens = list(range(1, 3 * BS + 1)), list(range(100, 100 + 3 * BS))
    a, b = block_digests(tier.root, a_tokens, BS), block_digests(tier.root, b_tokens, BS)
    try:
        tier.save(blocks_of(tier, a_tokens, [0, 1, 2], chained=True))
        wait_writes(tier, 3)
        tier.save(blocks_of(tier, b_tokens, [3, 4, 5], chained=True))
        wait_writes(tier, 6)
        # A's end went first (a2, then a1): A keeps a 1-block prefix, B all of its 3
        assert tier.lookup(a) == 1 and tier.lookup(b) == 3
        assert tier.index.lru_order() == [a[0], b[2], b[1], b[0]]
        # a load marks the chain used, head last: A's head is now the most recent
        assert tier.load("k", a[:1], [tuple(a_tokens[:BS])])
        assert wait_load(tier)[0].num_blocks == 1
        assert tier.index.lru_order() == [b[2], b[1], b[0], a[0]]
        order = tier.index.lru_order()
    finally:
        tier.close()
    again = DiskTier(tmp_path, 4 * size, FIELDS, caches())
    try:
        assert again.index.lru_order() == order
    finally:
        again.close()


def test_a_full_write_queue_drops_and_counts(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30, FIELDS, caches(), queue_bytes=1)
    try:
        tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))  # room for no block at all
        assert tier.stats.writes_dropped == 4 and tier.stats.blocks_written == 0
    finally:
        tier.close()


def test_the_write_queue_always_holds_min_queue_blocks(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30, FIELDS, caches(), queue_bytes=1, min_queue_blocks=3)
    try:
        assert tier.queue_bytes == 3 * tier.payload_nbytes
        tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))  # room for 3 of the 4
        assert tier.stats.writes_dropped == 1
        wait_writes(tier, 3)
    finally:
        tier.close()


def test_saves_at_eviction_count_only_the_blocks_not_held_yet(tier):
    blocks = blocks_of(tier, TOKENS, [0, 1, 2, 3])
    tier.save(blocks[:2])
    wait_writes(tier, 2)
    tier.save(blocks, evicting=True)  # the pool evicts all four: two were on disk already
    wait_writes(tier, 4)
    assert tier.stats.eviction_saves == 2 and tier.stats.blocks_written == 4


def test_a_full_disk_turns_the_tier_off_with_a_log_line(tmp_path, tier, monkeypatch, caplog):
    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("service.worker.kv_disk_tier.write_block_file", full)
    caplog.set_level(logging.ERROR, logger="service.worker.kv_disk_tier")
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))
    deadline = time.monotonic() + 10
    while tier.enabled:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "kv disk tier off" in caplog.text and "No space left" in caplog.text
    assert tier.lookup(block_digests(tier.root, TOKENS, BS)) == 0
    assert not tier.load("r", block_digests(tier.root, TOKENS, BS)[:1], [tuple(TOKENS[:BS])])
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))  # a no-op now, never an error


def test_start_up_scan_deletes_files_of_the_wrong_size(tmp_path, tier):
    tier.save(blocks_of(tier, TOKENS, [0, 1, 2, 3]))
    wait_writes(tier, 4)
    victim = tier.path_of(block_digests(tier.root, TOKENS, BS)[3])
    victim.write_bytes(victim.read_bytes()[:-7])
    tier.close()
    again = DiskTier(tmp_path, 1 << 30, FIELDS, caches())
    try:
        assert len(again.index) == 3 and again.stats.bad_files_at_start == 1
        assert not victim.exists()
    finally:
        again.close()


def directory_block_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.kvb"))


def test_engines_sharing_a_directory_share_one_budget(tmp_path):
    """Two engines (two fingerprints, as two servers of different models) on one DIR, each
    given a budget of 9 blocks: the directory holds at most 9 blocks' bytes, not 18."""
    size = block_file_bytes(tmp_path)
    budget = 9 * size
    a = DiskTier(tmp_path / "dir", budget, FIELDS, caches())
    b = DiskTier(tmp_path / "dir", budget, {**FIELDS, "model": "other"}, caches())
    try:
        written = 0
        for k in range(4):  # 4 sequences of 4 blocks each, alternating engines
            for tier in (a, b):
                tokens = [t + 1000 * (k + 1) + (0 if tier is a else 500) for t in TOKENS]
                tier.save(blocks_of(tier, tokens, [5, 2, 7, 1], chained=True))
                written += 4
                deadline = time.monotonic() + 10
                while tier._inflight_bytes or tier._queued:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert directory_block_bytes(tmp_path / "dir") <= budget
        assert a.stats.blocks_written + b.stats.blocks_written > 9  # eviction did happen
        assert a.stats.blocks_written and b.stats.blocks_written
        ledger = int((tmp_path / "dir" / ".kv-disk-bytes").read_text())
        assert ledger == directory_block_bytes(tmp_path / "dir")
    finally:
        a.close()
        b.close()
    # a restart recounts the directory, and a smaller budget evicts down to it
    c = DiskTier(tmp_path / "dir", 3 * size, FIELDS, caches())
    try:
        assert directory_block_bytes(tmp_path / "dir") <= 9 * size
        # c evicts its own blocks only: down to the budget, or to none where b's fill it
        assert directory_block_bytes(tmp_path / "dir") <= 3 * size or c.index.total_bytes == 0
        assert int((tmp_path / "dir" / ".kv-disk-bytes").read_text()) == \
            directory_block_bytes(tmp_path / "dir")
    finally:
        c.close()
