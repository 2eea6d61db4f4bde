"""Prefix caching, preemption by swap and recompute, and admission backpressure on the real model."""

from __future__ import annotations

import asyncio

import pytest

from protocol import ChatMessage, Delta, Done, Overloaded, SamplingParams
from service.engine.client import EngineRequest

SYSTEM = (
    "You are the reference librarian of a small public library in a coastal town. "
    "Patrons ask you about books, local history, the tides, opening hours and how to use "
    "the catalogue. The library opens at nine in the morning and closes at six in the "
    "evening from Monday to Friday, and at one in the afternoon on Saturdays; it is closed "
    "on Sundays and public holidays. Members may borrow up to eight books at once for three "
    "weeks, renew them twice online or at the desk, and reserve titles that are on loan. "
    "The local history room holds parish registers from 1720 onwards, maps of the harbour, "
    "photographs of the fishing fleet and the diaries of the lighthouse keepers, which may "
    "be read only in the room itself and only with clean, dry hands. The children's corner "
    "has story time every Wednesday afternoon. Printing costs ten cents a page, and the "
    "wireless network is free for everyone. Answer briefly, kindly and accurately; if you "
    "do not know something, say so and suggest whom the patron could ask instead, such as "
    "the harbour master, the town hall or the museum on the quay. Never invent opening "
    "hours or rules that are not written here, and always mention that the diaries of the "
    "lighthouse keepers are fragile when a patron asks about them."
)
QUESTIONS = [
    "When do you open on Saturday?", "How many books can I borrow?",
    "Can I take the lighthouse diaries home?", "How much does printing cost?",
    "Is there story time for children?", "Do you have maps of the harbour?",
    "Are you open on Sunday?", "Can I renew a book online?",
]


async def _run(engine, params: SamplingParams, **prompt) -> tuple[list[int], Done]:
    toks: list[int] = []
    async for ev in engine.generate(params=params, **prompt):
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
        elif isinstance(ev, Done):
            return toks, ev
    raise AssertionError("no done")


def _chat(q: str) -> dict:
    return {"messages": [ChatMessage("system", SYSTEM), ChatMessage("user", q)]}


async def test_shared_system_prompt_hits_prefix_cache_and_changes_nothing(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    cached = await make_engine()
    first, done0 = await _run(cached, greedy, **_chat(QUESTIONS[0]))
    assert done0.usage.cached_tokens == 0 and done0.usage.prompt_tokens >= 270
    rest = await asyncio.gather(*(_run(cached, greedy, **_chat(q)) for q in QUESTIONS[1:]))
    for toks, done in rest:
        assert done.usage.cached_tokens >= 256, done.usage
        assert done.usage.cached_tokens < done.usage.prompt_tokens
    stats = cached.scheduler.pool.stats
    assert stats.prefix_cache_hits >= 7 * 256 and stats.prefix_cache_queries > stats.prefix_cache_hits

    uncached = await make_engine(enable_prefix_caching=False)
    plain = await asyncio.gather(*(_run(uncached, greedy, **_chat(q)) for q in QUESTIONS))
    assert all(d.usage.cached_tokens == 0 for _, d in plain)
    assert [t for t, _ in plain] == [first] + [t for t, _ in rest]


@pytest.fixture(scope="module")
def preemption_prompts():
    return [f"Item {i}: the {w} is" for i, w in enumerate(
        "sun moon river stone cloud forest harbour bridge garden tower valley island".split())]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_tiny_pool_preempts_without_changing_any_token(make_engine, preemption_prompts,
                                                             mode):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 12 requests of ~8 + 24 tokens need 2 blocks of 16 each: 24 blocks; the pool has 10
    tiny = await make_engine(num_kv_blocks=10, max_num_seqs=12, preemption_mode=mode)
    outs = await asyncio.gather(*(_run(tiny, params, prompt=p) for p in preemption_prompts))
    assert all(len(t) == 24 and d.usage.completion_tokens == 24 for t, d in outs)
    assert sum(d.timings.preemptions for _, d in outs) > 0
    sched = tiny.scheduler
    assert (sched.num_swaps if mode == "swap" else sched.num_recomputes) > 0
    assert (sched.num_recomputes if mode == "swap" else sched.num_swaps) == 0

    roomy = await make_engine(num_kv_blocks=64)
    for p, (toks, _) in zip(preemption_prompts, outs):
        alone, done = await _run(roomy, params, prompt=p)
        assert done.timings.preemptions == 0
        assert toks == alone, p


async def test_full_admission_queue_answers_overloaded(make_engine):
    engine = await make_engine(max_num_seqs=1, max_waiting_requests=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    # token ids are admitted without a thread hop: no step runs between these three
    ids = engine.tokenizer.encode("Hello")
    streams = [await engine.open_stream(EngineRequest(
        prompt_token_ids=ids, params=params)) for _ in range(2)]
    with pytest.raises(Overloaded) as e:
        await engine.open_stream(EngineRequest(prompt_token_ids=ids, params=params))
    assert e.value.retry_after_ms >= 100 and e.value.to_frame().retryable
    for s in streams:
        async for _ in s:
            pass
    # the queue drained: requests are accepted again
    toks, done = await _run(engine, params, prompt="Hello")
    assert done.usage.completion_tokens == 4


async def test_request_larger_than_the_whole_pool_is_rejected(make_engine):
    from protocol import ContextLengthExceeded

    engine = await make_engine(num_kv_blocks=4)  # 64 tokens in all
    with pytest.raises(ContextLengthExceeded, match="KV blocks"):
        await engine.open_stream(EngineRequest(
            prompt="Hello", params=SamplingParams(max_tokens=100)))
