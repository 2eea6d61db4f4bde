"""Our forward and greedy generation against the transformers implementation (the oracle)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol import Delta, Done, SamplingParams
from service.worker.model_runner import ModelRunner
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tests.integration.greedy_prompts import GREEDY_PROMPTS



def _seq(rid, tokens, computed, blocks, sample=True):
    return ScheduledSequence(rid, tokens, computed, blocks, sample, SamplingParams(temperature=0))


def _logits(runner: ModelRunner, seqs) -> torch.Tensor:
    out = SchedulerOutput(seqs, sum(len(s.token_ids) for s in seqs), [])
    ids, pos, meta, idx = runner.prepare_inputs(out)
    return runner.model.forward(ids, pos, meta, runner.kv_caches, idx)


def test_prefill_and_decode_logits_match_transformers(loaded_model, hf_model, tokenizer,
                                                      small_config):
    # the fp32 oracle mode (auto's own bounds are test_auto_quantization's: its int16
    # activations, where chosen, move logits by up to 3e-2)
    runner = ModelRunner(small_config(num_kv_blocks=64, quantization=None), loaded_model)
    a = tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    b = tokenizer.encode("In 1492, Columbus")
    # prefill both in one step (all positions' logits are compared through the last one)
    got = _logits(runner, [_seq("a", a, 0, [0]), _seq("b", b, 0, [1, 2])])
    with torch.no_grad():
        ref_a = hf_model(torch.tensor([a])).logits[0, -1]
        ref_b = hf_model(torch.tensor([b])).logits[0, -1]
    torch.testing.assert_close(got[0], ref_a, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref_b, atol=2e-4, rtol=1e-4)
    # three decode steps of both sequences in one batch
    na, nb = got[0].argmax().item(), got[1].argmax().item()
    for _ in range(3):
        got = _logits(runner, [_seq("a", [na], len(a), [0]), _seq("b", [nb], len(b), [1, 2])])
        a, b = a + [na], b + [nb]
        with torch.no_grad():
            ref_a = hf_model(torch.tensor([a])).logits[0, -1]
            ref_b = hf_model(torch.tensor([b])).logits[0, -1]
        torch.testing.assert_close(got[0], ref_a, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], ref_b, atol=2e-4, rtol=1e-4)
        na, nb = got[0].argmax().item(), got[1].argmax().item()


def test_chunked_prefill_logits_match(loaded_model, hf_model, tokenizer, small_config):
    runner = ModelRunner(small_config(num_kv_blocks=64, block_size=8, quantization=None),
                         loaded_model)  # the fp32 oracle mode, as above
    ids = tokenizer.encode("Paged attention splits the KV cache into fixed-size blocks so "
                           "that memory is not wasted on fragmentation.")
    # the prompt in chunks of 5, the last chunk samples
    blocks = list(range(-(-len(ids) // 8)))
    for start in range(0, len(ids), 5):
        chunk = ids[start:start + 5]
        got = _logits(runner, [_seq("a", chunk, start, blocks, start + 5 >= len(ids))])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got[0], ref, atol=2e-4, rtol=1e-4)


PROMPTS = GREEDY_PROMPTS


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tokenizer, loaded_model):
    """transformers' greedy generate, 32 new tokens, for each prompt; an EOS that ends it
    is dropped (a stop token is not part of our completion: PROTOCOL-facing rule)."""
    out = {}
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                    max_new_tokens=32, do_sample=False, pad_token_id=2)
        toks = gen[0, len(ids):].tolist()
        if toks and toks[-1] in loaded_model.eos_token_ids:
            toks.pop()
        out[p] = toks
    return out


async def _greedy(engine, prompt: str, tokenizer, n: int = 32) -> list[int]:
    toks: list[int] = []
    async for ev in engine.generate(prompt_token_ids=tokenizer.encode(prompt),
                                    params=SamplingParams(temperature=0, max_tokens=n)):
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
        else:
            assert isinstance(ev, Done)
    return toks


async def test_greedy_matches_transformers_alone(make_engine, tokenizer, hf_greedy):
    engine = await make_engine()
    for p in PROMPTS:
        assert await _greedy(engine, p, tokenizer) == hf_greedy[p], p


async def test_greedy_matches_transformers_batched_with_chunked_prefill(
        make_engine, tokenizer, hf_greedy):
    # a budget of 8 tokens forces every prompt through several prefill chunks,
    # mixed with the decodes of the prompts that started earlier
    engine = await make_engine(max_num_batched_tokens=8, block_size=8)
    outs = await asyncio.gather(*(_greedy(engine, p, tokenizer) for p in PROMPTS))
    for p, got in zip(PROMPTS, outs):
        assert got == hf_greedy[p], p
    engine.scheduler.check_integrity()
