"""Exact unit tests of the continuous-batching scheduler with a fake runner (no model)."""

from __future__ import annotations

from protocol import SamplingParams
from service.block_pool import KVBlockPool
from service.config import SchedulerConfig
from service.request import Request, RequestStatus
from service.scheduler import Scheduler


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=8, prefix=True) -> Scheduler:
    pool = KVBlockPool(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     pool, max_model_len=1024)


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
