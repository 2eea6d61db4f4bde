"""Exact unit tests of the continuous-batching scheduler with a fake runner (no model)."""

from __future__ import annotations

from protocol import SamplingParams
from service.core.block_pool import KVBlockPool
from service.config import CacheConfig, SchedulerConfig
from service.core.request import Request, RequestStatus
from service.core.scheduler import PreemptionCost, Scheduler
from service.core.swap_space import SwapSpace


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=8, prefix=True,
         watermarks=(1.0, 1.0, 1.0), mode="recompute", swap_blocks=0, cost=None) -> Scheduler:
    """A scheduler over a small pool; watermarks (low, high, critical) off by default."""
    pool = KVBlockPool(num_blocks, block_size, prefix)
    low, high, critical = watermarks
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        preemption_mode=mode),
        pool, max_model_len=1024,
        cache=CacheConfig(kv_watermark_low=low, kv_watermark_high=high,
                          kv_watermark_critical=critical),
        swap=SwapSpace(swap_blocks) if swap_blocks else None, cost=cost)


def req(rid: str, n_prompt: int, t: float, max_tokens: int = 100, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   arrival_time=t)


def step(s: Scheduler, token: int = 7):
    """schedule + a fake forward that samples `token` for every sampling sequence."""
    out = s.schedule()
    sampled = {q.request_id: token for q in out.sequences if q.sample}
    s.update_from_output(out, sampled)
    s.check_integrity()
    return [(q.request_id, len(q.token_ids), q.num_computed_tokens, q.sample) for q in out.sequences]


def test_chunked_prefill_mixed_with_decode():
    s = make(budget=8)
    s.add_request(req("a", 6, 0.0))
    s.add_request(req("b", 10, 1.0))
    assert step(s) == [("a", 6, 0, True), ("b", 2, 0, False)]
    assert s.requests["a"].block_ids == [0, 1] and s.requests["b"].block_ids == [2]
    # decodes first, then b's next chunk fills the remaining budget
    assert step(s) == [("a", 1, 6, True), ("b", 7, 2, False)]
    assert s.requests["b"].block_ids == [2, 3, 4]
    assert step(s) == [("a", 1, 7, True), ("b", 1, 9, True)]
    assert step(s) == [("a", 1, 8, True), ("b", 1, 10, True)]
    assert s.requests["a"].output_token_ids == [7, 7, 7, 7]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2, budget=64)
    for i, name in enumerate("abc"):
        s.add_request(req(name, 3, float(i)))
    assert [x[0] for x in step(s)] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish_request("a", "stop")
    assert [x[0] for x in step(s)] == ["b", "c"]


def test_finish_frees_blocks_and_integrity_holds():
    s = make()
    s.add_request(req("a", 5, 0.0))
    step(s)
    assert s.pool.num_free_blocks == 14
    s.finish_request("a", "cancelled")
    assert s.pool.num_free_blocks == 16 and not s.has_unfinished()
    s.check_integrity()
    assert s.finish_request("a", "cancelled") is None


def test_preempt_newest_by_recompute_and_resume_first():
    # 4 blocks of 2 tokens: a and b each hold 2 blocks after their prompts of 3 tokens
    s = make(num_blocks=4, block_size=2, budget=16)
    s.add_request(req("a", 3, 0.0))
    s.add_request(req("b", 3, 1.0, base=100))
    assert step(s) == [("a", 3, 0, True), ("b", 3, 0, True)]
    # both now have 4 tokens in 2 blocks; the next decode needs a 3rd block for each
    assert step(s) == [("a", 1, 3, True), ("b", 1, 3, True)]
    out = s.schedule()
    # a needs block 5 -> no free block -> the newest (b) is preempted, a goes on
    assert out.preempted == ["b"]
    assert [(q.request_id, len(q.token_ids)) for q in out.sequences] == [("a", 1)]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and list(s.waiting) == [b]
    s.update_from_output(out, {"a": 7})
    s.check_integrity()
    s.finish_request("a", "stop")
    # b resumes: its first block is still in the prefix cache (a took b's tail block,
    # evicting it), so the other 3 of its 5 tokens are prefilled again, then it samples
    assert step(s) == [("b", 3, 2, True)]
    assert b.output_token_ids == [7, 7, 7]


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(budget=64)
    s.add_request(req("a", 9, 0.0))
    step(s)
    s.finish_request("a", "stop")
    s.add_request(req("b", 9, 1.0))
    # 2 full blocks (8 tokens) hit; only the 9th token is computed
    assert step(s) == [("b", 1, 8, True)]
    assert s.requests["b"].num_cached_tokens == 8
    assert s.pool.stats.prefix_cache_hits == 8 and s.pool.stats.prefix_cache_queries == 18


def test_no_prefix_hit_when_disabled():
    s = make(budget=64, prefix=False)
    s.add_request(req("a", 9, 0.0))
    step(s)
    s.finish_request("a", "stop")
    s.add_request(req("b", 9, 1.0))
    assert step(s) == [("b", 9, 0, True)]


def _two_running_full_pool(**kw) -> Scheduler:
    """a and b (3-token prompts, 1 output token each) fill a 4-block pool of 2-token blocks."""
    s = make(num_blocks=4, block_size=2, budget=16, **kw)
    s.add_request(req("a", 3, 0.0))
    s.add_request(req("b", 3, 1.0, base=100))
    step(s)
    step(s)
    return s


def test_swap_preemption_keeps_computed_tokens_and_swaps_back_in():
    s = _two_running_full_pool(mode="swap", swap_blocks=4)
    b = s.requests["b"]
    assert b.block_ids == [2, 3]
    out = s.schedule()
    assert out.preempted == ["b"] and out.swap_out == [(2, 0), (3, 1)]
    assert b.status is RequestStatus.SWAPPED and b.cpu_block_ids == [0, 1]
    assert b.num_computed_tokens == 4 and s.num_swaps == 1 and s.num_recomputes == 0
    s.update_from_output(out, {"a": 7})
    s.check_integrity()
    s.finish_request("a", "stop")
    out = s.schedule()
    # b's two CPU blocks come back into fresh device blocks, plus one for its next token
    assert [(q.request_id, len(q.token_ids), q.num_computed_tokens) for q in out.sequences] == \
        [("b", 1, 4)]
    assert out.swap_in == [(0, 2), (1, 3)] and b.block_ids == [2, 3, 1]
    assert s.kv.swap.num_free_blocks == 4
    s.update_from_output(out, {"b": 8})
    s.check_integrity()


def test_auto_mode_follows_the_cost_model():
    fast_swap = PreemptionCost(kv_bytes_per_block=1000, swap_bytes_per_s=1e9,
                               prefill_tokens_per_s=100.0)
    s = _two_running_full_pool(mode="auto", swap_blocks=4, cost=fast_swap)
    assert s.schedule().swap_out  # swapping 2 KB beats recomputing 4 tokens at 100 tok/s
    slow_swap = PreemptionCost(kv_bytes_per_block=10**9, swap_bytes_per_s=1e6,
                               prefill_tokens_per_s=1e6)
    s = _two_running_full_pool(mode="auto", swap_blocks=4, cost=slow_swap)
    out = s.schedule()
    assert out.preempted == ["b"] and not out.swap_out
    assert s.requests["b"].status is RequestStatus.PREEMPTED


def test_high_watermark_stops_new_prefill_until_below_low():
    # 10 blocks of 4 tokens; high 0.5, low 0.3
    s = make(num_blocks=10, block_size=4, budget=64, watermarks=(0.3, 0.5, 1.0))
    s.add_request(req("a", 20, 0.0))                       # 5 blocks -> usage 0.5
    assert [x[0] for x in step(s)] == ["a"]
    s.add_request(req("b", 3, 1.0))
    assert [x[0] for x in step(s)] == ["a"]                # usage >= high: b may not start
    assert not s.admitting and s.requests["b"].status is RequestStatus.WAITING
    s.finish_request("a", "stop")
    assert [x[0] for x in step(s)] == ["b"]                # usage 0 < low: admission reopens
    assert s.admitting


def test_critical_watermark_preempts_newest():
    s = make(num_blocks=10, block_size=4, budget=64, watermarks=(0.5, 0.6, 0.8))
    s.add_request(req("a", 15, 0.0))                       # 4 blocks
    s.add_request(req("b", 15, 1.0))                       # 4 blocks -> usage 0.8
    step(s)
    step(s)
    step(s)                                                # a, b took a 5th block each
    assert s.pool.usage == 1.0
    out = s.schedule()
    assert out.preempted == ["b"] and [q.request_id for q in out.sequences] == ["a"]


def test_copy_on_write_of_a_shared_partial_block():
    s = make(num_blocks=8, block_size=4, budget=16)
    s.add_request(req("a", 6, 0.0))
    step(s)                                                # a: blocks [0, 1], 6 computed
    a = s.requests["a"]
    # fork a into b sharing both blocks (as parallel sampling would)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=100), arrival_time=1.0)
    b.output_token_ids = list(a.output_token_ids)
    s.pool.take_cached(a.block_ids)
    b.block_ids = list(a.block_ids)
    b.num_computed_tokens = a.num_computed_tokens
    b.status = RequestStatus.RUNNING
    s.requests["b"] = b
    s.running.append(b)
    out = s.schedule()
    # a writes token 6 into block 1 (shared, partly filled): a gets a copy; then b is the
    # only holder of block 1 and writes in place
    assert out.copy_blocks == [(1, 2)]
    assert a.block_ids == [0, 2] and b.block_ids == [0, 1]
    s.update_from_output(out, {"a": 7, "b": 7})
    s.check_integrity()


def _long_then_short(threshold=None, max_num_seqs=8):
    """A 40-token prompt one step into its prefill (budget 8), then a 3-token one arrives."""
    pool = KVBlockPool(32, 4, True)
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8,
                                  long_prefill_token_threshold=threshold),
                  pool, max_model_len=1024,
                  cache=CacheConfig(kv_watermark_low=1.0, kv_watermark_high=1.0,
                                    kv_watermark_critical=1.0))
    s.add_request(req("long", 40, 0.0))
    assert step(s) == [("long", 8, 0, False)]  # alone: the whole budget
    s.add_request(req("short", 3, 1.0, base=500))
    return s


def test_a_prompt_that_arrives_during_a_long_prefill_starts_beside_it():
    s = _long_then_short()
    # while "short" waits, the long prompt's chunk takes half the budget, "short" its 3
    # tokens, and the one token left goes back to the long chunk
    assert step(s) == [("long", 5, 8, False), ("short", 3, 0, True)]
    # nothing waits any more: the whole budget again, beside short's decode
    assert step(s) == [("short", 1, 3, True), ("long", 7, 13, False)]


def test_threshold_sets_the_cap_and_zero_keeps_first_come_first_served():
    assert step(_long_then_short(threshold=5)) == [("long", 5, 8, False), ("short", 3, 0, True)]
    s = _long_then_short(threshold=0)
    assert step(s) == [("long", 8, 8, False)]  # no cap: the newcomer waits for the budget
    assert [r.request_id for r in s.waiting] == ["short"]


def test_no_cap_when_the_newcomer_could_not_start():
    s = _long_then_short(max_num_seqs=1)  # the sequence cap: "short" cannot start now
    assert step(s) == [("long", 8, 8, False)]


def test_budget_the_newcomers_leave_goes_back_to_the_held_chunk():
    # "short" waits but cannot start (no KV block free for it): the long chunk gets the
    # whole budget back rather than running at the cap while the rest of the step idles
    pool = KVBlockPool(2, 8, True)  # 16 tokens of KV in all, blocks of 8
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), pool,
                  max_model_len=1024, cache=CacheConfig(kv_watermark_low=1.0,
                                                       kv_watermark_high=1.0,
                                                       kv_watermark_critical=1.0))
    s.add_request(req("long", 14, 0.0))
    assert step(s) == [("long", 8, 0, False)]
    s.add_request(req("short", 9, 1.0, base=500))  # the capped chunk takes the last block
    assert step(s) == [("long", 6, 8, True)]  # capped at 4, then topped up to its end
    assert [r.request_id for r in s.waiting] == ["short"]
