"""Logprobs of sampled and prompt tokens, from the real engine, against the transformers
oracle: log_softmax of its raw logits (SamplingParams.logprobs / prompt_logprobs)."""

from __future__ import annotations

import pytest
import torch

from protocol import Delta, Done, InvalidRequest, SamplingParams
from service.engine.llm import LLM
from service.engine.client import EngineRequest

PROMPT = "The quick brown fox jumps over the lazy dog because it was"
ATOL = 2e-3  # fp32 engine against fp32 transformers: logits agree to 2e-4 (test_oracle)


def _oracle(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-probabilities of the next token after each prefix."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


async def _collect(engine, **kw) -> tuple[list[int], list, list | None, list[int] | None]:
    ids: list[int] = []
    lps: list = []
    prompt_lps = prompt_ids = None
    deltas = 0
    async for ev in engine.generate(**kw):
        if isinstance(ev, Delta):
            deltas += 1
            if ev.prompt_logprobs is not None:
                assert prompt_lps is None, "prompt logprobs came twice"
                assert deltas == 1, "prompt logprobs come with the first delta"
                prompt_lps, prompt_ids = ev.prompt_logprobs, ev.prompt_token_ids
            ids += ev.token_ids
            if ev.logprobs is not None:
                assert len(ev.logprobs) == len(ev.token_ids)
                lps += ev.logprobs
        else:
            assert isinstance(ev, Done), ev
    return ids, lps, prompt_lps, prompt_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_sampled_token_logprobs_match_the_oracle(make_engine, hf_model, tokenizer,
                                                       temperature):
    engine = await make_engine(quantization=None)
    prompt = tokenizer.encode(PROMPT)
    ids, lps, prompt_lps, _ = await _collect(
        engine, prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=6, temperature=temperature, seed=7, logprobs=5,
                              ignore_eos=True))
    assert prompt_lps is None
    assert len(ids) == len(lps) == 6
    ref = _oracle(hf_model, prompt + ids)[len(prompt) - 1:-1]  # [6, V]: each sampled position
    for k, (token, lp) in enumerate(zip(ids, lps)):
        # the raw distribution, whatever the temperature
        assert lp.logprob == pytest.approx(ref[k, token].item(), abs=ATOL)
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        ref_top = ref[k].topk(5)
        torch.testing.assert_close(torch.tensor(values), ref_top.values, atol=ATOL, rtol=0)
        assert lp.top[0][0] == ref_top.indices[0].item()
        if temperature == 0.0:  # greedy: the chosen token is the most likely one
            assert token == lp.top[0][0]


async def test_prompt_logprobs_over_chunks_match_the_oracle(make_engine, hf_model, tokenizer):
    # 8-token chunks: the prompt is scored over several steps, whatever the chunking;
    # the prompt is in the prefix cache beforehand and still scored (no cache hit)
    engine = await make_engine(quantization=None, max_num_batched_tokens=8)
    prompt = tokenizer.encode(PROMPT * 2)
    await _collect(engine, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))
    ids, lps, prompt_lps, prompt_ids = await _collect(
        engine, prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, logprobs=0,
                              ignore_eos=True))
    assert prompt_ids == prompt
    assert len(prompt_lps) == len(prompt)
    assert prompt_lps[0] is None
    ref = _oracle(hf_model, prompt)
    for p in range(1, len(prompt)):
        lp = prompt_lps[p]
        assert lp.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=ATOL), p
        assert [t for t, _ in lp.top] == ref[p - 1].topk(2).indices.tolist()
    assert [len(lp.top) for lp in lps] == [0, 0]


async def test_prompt_logprobs_arrive_when_the_first_token_is_a_stop_token(make_engine,
                                                                          tokenizer):
    # the greedy first token made a stop token: nothing is generated, the scores still come
    engine = await make_engine()
    prompt = tokenizer.encode("Hello, my name is")
    first, _, _, _ = await _collect(engine, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=1, temperature=0.0))
    ids, _, prompt_lps, _ = await _collect(
        engine, prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0,
                              stop_token_ids=(first[0],)))
    assert ids == []
    assert prompt_lps is not None and len(prompt_lps) == len(prompt)


async def test_requests_without_logprobs_get_none(make_engine, tokenizer):
    engine = await make_engine()
    ids, lps, prompt_lps, _ = await _collect(
        engine, prompt_token_ids=tokenizer.encode(PROMPT),
        params=SamplingParams(max_tokens=3, temperature=0.0))
    assert ids and lps == [] and prompt_lps is None


async def test_logprobs_out_of_range_are_refused(make_engine, tokenizer):
    engine = await make_engine()
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest) as e:
            await engine.open_stream(EngineRequest(prompt="Hi", params={name: 21}))
        assert e.value.param == f"$.params.{name}"


def test_llm_refuses_logprobs_it_cannot_return(loaded_model):
    llm = LLM(loaded=loaded_model, num_kv_blocks=64)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest) as e:
            llm.generate([[1, 2, 3]], {"max_tokens": 2, name: 1})
        assert e.value.param == f"$.params.{name}"
