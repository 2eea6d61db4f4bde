"""Write-behind and read-ahead through the scheduler (service.core.disk_prefix) on a
NullRunner and an in-memory disk tier: exact block ids, a loading request waits while
others run, failed and partial loads, aborts during a load, and the pool's invariants."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.core.engine_core import EngineCore
from service.core.kv_digest import block_digests
from service.core.null_runner import NullRunner
from service.core.request import Request
from tests.support.fake_disk_tier import FakeDiskTier

BS = 4
A_PROMPT = list(range(1, 11))  # 10 tokens; A generates 100, 101, 102


def make(tier: FakeDiskTier, num_blocks: int = 64,
         preemption_mode: str = "recompute") -> EngineCore:
    """No CPU swap blocks (NullRunner's default): "swap" finds its swap space full."""
    runner = NullRunner(num_blocks, max_model_len=512, token_fn=lambda rid, pos: 100 + pos)
    cfg = EngineConfig(
        cache=CacheConfig(block_size=BS, kv_watermark_low=1.0, kv_watermark_high=1.0,
                          kv_watermark_critical=1.0),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                  preemption_mode=preemption_mode))
    return EngineCore(cfg, runner, disk=tier)


def req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))


def step(core: EngineCore) -> list:
    out = core.step()
    core.check_integrity()
    return out


def finish_a(core: EngineCore, tier: FakeDiskTier) -> None:
    core.add_request(req("A", A_PROMPT, 3))
    while core.has_unfinished():
        step(core)
    core.scheduler.pool.reset_prefix_cache()  # as after eviction, or a restart


def test_finished_request_blocks_are_saved_with_exact_ids_and_tokens():
    tier = FakeDiskTier()
    core = make(tier)
    finish_a(core, tier)
    # 10 prompt tokens + 2 outputs have K/V (the third output was never run): 3 full blocks
    tokens = A_PROMPT + [100, 101]
    digests = block_digests(tier.root, tokens, BS)
    # once its prompt is done (first token), then all of them when it ends (the tier skips
    # what it already holds)
    prompt_done, ended = tier.save_calls
    expected = [(digests[0], (1, 2, 3, 4), 0), (digests[1], (5, 6, 7, 8), 1),
                (digests[2], (9, 10, 100, 101), 2)]
    assert [(b.digest, b.token_ids, b.block_id) for b in prompt_done] == expected[:2]
    assert [(b.digest, b.token_ids, b.block_id) for b in ended] == expected


def test_a_loading_request_waits_while_others_run_then_starts_from_its_disk_prefix():
    tier = FakeDiskTier()
    core = make(tier)
    finish_a(core, tier)
    runner = core.runner
    calls_before = len(runner.calls)
    b_prompt = A_PROMPT + [100, 101, 7, 8, 9]  # 15 tokens: 3 full blocks on disk
    core.add_request(req("B", b_prompt, 2))
    core.add_request(req("C", [1000, 1001, 1002, 1003, 1004], 2))
    step(core)
    assert list(tier.loads) == ["B"] and len(tier.loads["B"][0]) == 3
    assert runner.calls[calls_before:] == [["C"]]  # B waits on its load, C runs
    step(core)
    assert runner.calls[calls_before:] == [["C"], ["C"]]
    assert core.scheduler.idle_until() is not None  # the idle loop polls for the load
    tier.complete("B")
    step(core)
    assert tier.installs == [("B", [5, 6, 7])]
    b = core.get_request("B")
    assert b.block_ids == [5, 6, 7, 8] and b.num_cached_tokens == 12
    assert b.num_disk_cached_tokens == 12
    assert runner.calls[-1] == ["B"]
    stats = core.stats()
    assert stats.prefix_disk_hits == 12 and stats.prefix_hits == 12
    while core.has_unfinished():
        step(core)
    assert core.scheduler.pool.usage == 0.0


def test_a_failed_or_partial_load_recomputes_the_rest():
    for n, cached in ((0, 0), (2, 8)):
        tier = FakeDiskTier()
        core = make(tier)
        finish_a(core, tier)
        b = req("B", A_PROMPT + [100, 101, 7], 1)
        core.add_request(b)
        step(core)
        tier.complete("B", n)
        step(core)
        assert b.num_cached_tokens == cached and b.num_disk_cached_tokens == cached
        if n == 0:
            assert tier.discarded == ["B"] and tier.installs == []
        while core.has_unfinished():
            step(core)


def test_abort_during_a_load_drops_its_result_and_leaks_nothing():
    tier = FakeDiskTier()
    core = make(tier)
    finish_a(core, tier)
    core.add_request(req("B", A_PROMPT + [100, 101, 7], 1))
    step(core)
    assert "B" in tier.loads
    core.abort("B")
    tier.complete("B")
    step(core)
    assert tier.discarded == ["B"] and tier.installs == []
    assert not core.has_unfinished() and core.scheduler.pool.usage == 0.0
    assert core.scheduler.idle_until() is None


def test_a_request_that_fails_is_not_saved():
    tier = FakeDiskTier()
    core = make(tier)
    core.add_request(req("A", list(range(1, 21)), 5))  # 20 tokens: a 16-token chunk first
    step(core)
    assert core.get_request("A").num_computed_tokens == 16
    core.finish_request("A", "error", "boom")  # its 4 full blocks are never saved
    step(core)
    assert tier.save_calls == []
    core.add_request(req("D", A_PROMPT, 1))
    core.finish_request("D", "cancelled")  # never ran: nothing computed, nothing saved
    step(core)
    assert tier.save_calls == []


def test_a_disabled_tier_is_never_asked():
    tier = FakeDiskTier()
    core = make(tier)
    finish_a(core, tier)
    tier.enabled = False
    core.add_request(req("B", A_PROMPT + [100, 101, 7], 1))
    step(core)
    assert tier.loads == {} and core.runner.calls[-1] == ["B"]  # ran at once, no load
    assert not core.has_unfinished()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_recompute_preemption_writes_its_blocks_and_its_resume_reads_them_back(mode):
    """With "swap" there is no swap space left: the preemption spills B's KV to disk."""
    tier = FakeDiskTier()
    core = make(tier, num_blocks=8, preemption_mode=mode)  # 32 tokens: not both at 20
    a, b = req("A", list(range(1, 9)), 12), req("B", list(range(50, 58)), 12)
    core.add_request(a)
    core.add_request(b)
    for _ in range(200):
        if b.num_preemptions:
            break
        step(core)
    assert b.num_preemptions == 1 and b.status.value == "preempted" and not b.cpu_block_ids
    saved_b = [blk for call in tier.save_calls for blk in call if blk.token_ids[0] >= 50]
    assert saved_b and len(saved_b) >= 2  # its prompt's 2 blocks at least
    while "B" not in tier.loads:  # on resume, the block past its pool hit is on disk
        assert core.has_unfinished()
        step(core)
    while not a.is_finished:  # B waits on its load meanwhile, A runs (and frees room)
        assert "B" not in core.runner.calls[-1]
        step(core)
    tier.complete("B")
    step(core)
    assert tier.installs[-1][0] == "B"
    assert core.stats().prefix_disk_hits > 0
    while core.has_unfinished():
        step(core)
    assert len(b.output_token_ids) == 12 and core.scheduler.pool.usage == 0.0


def test_a_load_whose_pool_prefix_was_evicted_meanwhile_is_looked_up_again():
    tier = FakeDiskTier()
    core = make(tier, num_blocks=6)
    core.add_request(req("A", A_PROMPT, 3))
    while core.has_unfinished():
        step(core)  # free queue now [3, 4, 5, 2, 1, 0]: A's blocks cached, tail first
    c = req("C", list(range(200, 213)), 3)
    core.add_request(c)
    step(core)  # C takes 4 blocks, evicting A's block 2 from the pool (not from disk)
    assert c.block_ids == [3, 4, 5, 2]
    b = req("B", A_PROMPT + [100, 101, 7], 1)
    d = req("D", list(range(300, 305)), 2)
    core.add_request(b)
    core.add_request(d)
    step(core)  # B: pool hit 2 blocks, block 2 read from disk; D evicts blocks 1 and 0
    assert len(tier.loads["B"][0]) == 1 and d.block_ids == [1, 0]
    tier.complete("B")
    step(core)  # the load arrives after its pool prefix is gone: dropped, B looked up again
    assert tier.discarded == ["B"] and b.num_cached_tokens == -1
    for _ in range(5):  # (as soon as the pool is under its high watermark)
        if "B" in tier.loads:
            break
        step(core)
    assert len(tier.loads["B"][0]) == 3  # from block 0 now
    while not (c.is_finished and d.is_finished):
        step(core)
    tier.complete("B")
    step(core)
    assert len(tier.installs) == 1 and len(tier.installs[0][1]) == 3
    assert b.num_cached_tokens == 12 and b.num_disk_cached_tokens == 12
    while core.has_unfinished():
        step(core)


def test_a_request_that_scores_its_prompt_never_loads_from_disk():
    # prompt logprobs need every prompt position run: a disk prefix would be wasted reads
    tier = FakeDiskTier()
    core = make(tier)
    finish_a(core, tier)
    b_prompt = A_PROMPT + [100, 101, 7, 8, 9]
    core.add_request(Request("B", b_prompt, SamplingParams(max_tokens=2, temperature=0,
                                                           prompt_logprobs=0)))
    outs = []
    for _ in range(50):  # a load would wait for the fake tier's complete(): bounded
        if not core.has_unfinished():
            break
        outs += step(core)
    assert tier.loads == {} and tier.installs == []
    assert not core.has_unfinished()
    first = next(o for o in outs if o.request_id == "B")
    assert len(first.prompt_logprobs) == len(b_prompt)
    assert core.scheduler.pool.usage == 0.0


def test_a_dropped_save_is_offered_again_when_the_pool_evicts_the_block():
    tier = FakeDiskTier()
    core = make(tier, num_blocks=6)
    tier.drop_saves = True  # as a full write queue: A's saves are lost
    core.add_request(req("A", A_PROMPT, 3))
    while core.has_unfinished():
        step(core)  # free queue now [3, 4, 5, 2, 1, 0]: A's 3 full blocks cached
    assert tier.saved == {}
    tier.drop_saves = False
    c = req("C", list(range(200, 213)), 3)
    core.add_request(c)
    step(core)  # C takes 4 blocks: evicts A's last full block (2) from the pool
    assert c.block_ids == [3, 4, 5, 2]
    digests = block_digests(tier.root, A_PROMPT + [100, 101], BS)
    assert [[(b.digest, b.block_id) for b in call] for call in tier.eviction_saves] == \
        [[(digests[2], 2)]]
    assert digests[2] in tier.saved and digests[0] not in tier.saved  # 0 is still pooled
    while core.has_unfinished():
        step(core)


def test_a_block_reused_since_it_was_noted_is_not_offered_under_its_old_digest():
    tier = FakeDiskTier()
    core = make(tier, num_blocks=6)
    core.add_request(req("A", A_PROMPT, 3))
    while core.has_unfinished():
        step(core)  # A's blocks 0, 1, 2 noted (and saved)
    core.scheduler.pool.reset_prefix_cache()  # their ids are reused with no eviction
    tier.enabled = False  # so B's blocks are never noted: A's entries stay
    b = req("B", list(range(300, 321)), 1)  # 21 tokens: blocks 3, 4, 5, 2, 1, 0
    core.add_request(b)
    while core.has_unfinished():
        step(core)
    tier.enabled = True
    core.add_request(req("C", list(range(400, 421)), 1))  # evicts B's cached blocks
    while core.has_unfinished():
        step(core)
    a_digests = set(block_digests(tier.root, A_PROMPT + [100, 101], BS))
    offered = {blk.digest for call in tier.save_calls[2:] for blk in call}
    assert not offered & a_digests  # B's K/V is never written under A's digests


def test_a_long_running_request_saves_its_decoded_blocks_in_groups():
    from service.core.disk_prefix import DECODE_NOTE_BLOCKS

    tier = FakeDiskTier()
    core = make(tier)
    max_tokens = 4 * DECODE_NOTE_BLOCKS + 4
    a = req("A", A_PROMPT, max_tokens)  # 10 prompt tokens: 2 full blocks at prompt done
    core.add_request(a)
    while len(tier.save_calls) < 2:
        step(core)
    # the second save comes while A decodes, once DECODE_NOTE_BLOCKS more blocks are full
    assert not a.is_finished
    assert a.num_computed_tokens == BS * (2 + DECODE_NOTE_BLOCKS)
    digests = block_digests(tier.root, a.token_slice(0, a.num_computed_tokens), BS)
    assert [b.digest for b in tier.save_calls[1]] == digests[2:2 + DECODE_NOTE_BLOCKS]
    assert [b.block_id for b in tier.save_calls[1]] == a.block_ids[2:2 + DECODE_NOTE_BLOCKS]
    while core.has_unfinished():
        step(core)
