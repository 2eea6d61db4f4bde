"""--batch-invariant on the real model: a request's greedy tokens AND its logits are the same
bits alone, batched with prompts of other lengths (chunked prefill mixed with decodes), and
after a prefix-cache hit, in fp32, int8, int4 and auto, and in auto over 16-bit KV caches.

The kernel choice is made by a deterministic fake timer that serves buckets 1 and 64 with
the AVX-512 build and 16 and 512 with the AVX2 build (where both run): a layer then
switches builds with the row count, which must not change a bit either.
"""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention_cpu as dac
from kernels import quant_linear_cpu as qlc
from protocol import SamplingParams
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.engine.llm import LLM
from service.worker.quantization import choice
from service.core.request import Request

pytestmark = pytest.mark.skipif(
    not qlc.available_isas() or not dac.kernel_available(),
    reason="batch invariance needs our C++ kernels, which do not build or run here")

PROMPT = ("Bread begins with four ingredients and a great deal of patience. Flour and water, "
          "left to rest together, form gluten: long elastic proteins that trap the gas")
OTHERS = ["Hi", "List three primary colors and explain why each of them cannot be mixed from "
          "the others, with an example of a painting that uses them well.",
          "The capital of France is"]
MAX_TOKENS = 6


def _fake_timer(cls, rows, makers):
    """avx512 wins at 1 and 64 rows, avx2 at 16 and 512 (when both exist); never runs."""
    prefer = "avx512" if rows in (1, 64) else "avx2"
    return {name: 1.0 if name.endswith(prefer) else 2.0 for name in makers}


class _Recorder:
    """Wraps a runner's execute to keep each request's logits rows, step by step."""

    def __init__(self, llm: LLM) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}
        runner = llm.runner
        forward, execute = runner.model.forward, runner.execute
        last: list[torch.Tensor] = []

        def recording_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            last.append(out.clone())
            return out

        def recording_execute(out):
            last.clear()
            result = execute(out)
            sampling = [s.request_id for s in out.sequences if s.sample]
            if sampling:
                for rid, row in zip(sampling, last[0]):
                    self.logits.setdefault(rid, []).append(row)
            return result

        runner.model.forward = recording_forward
        runner.execute = recording_execute


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[Request]]:
    """Greedy run of all prompts together; returns tokens and the requests."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = []
    for ids in prompts:
        req = Request(f"r{llm._next_id}", list(ids), params, frozenset())
        llm._next_id += 1
        llm.core.add_request(req)
        reqs.append(req)
    while llm.core.has_unfinished():
        llm.core.step()
    llm.core.check_integrity()
    return [r.output_token_ids for r in reqs], reqs


@pytest.mark.parametrize("quantization,kv_cache_dtype", [
    (None, "auto"), ("int8", "auto"), ("int4", "auto"), ("auto", "auto"),
    ("auto", "float16"), ("auto", "bfloat16")])
def test_greedy_tokens_and_logits_are_the_same_bits(loaded_model, tokenizer, monkeypatch,
                                                    quantization, kv_cache_dtype) -> None:
    monkeypatch.setattr(choice, "default_timer", _fake_timer)
    monkeypatch.setattr(choice, "_save_cache", lambda timings: None)
    monkeypatch.setattr(choice, "_load_cache", lambda: {})
    # nor in the process's own memory, which keeps a busy machine's timings: from there the
    # fake ones reached later runners of the suite (and the disk, with their next save)
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    llm = LLM(loaded=loaded_model, config=EngineConfig(
        model=ModelConfig(quantization=quantization, batch_invariant=True),
        cache=CacheConfig(num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24)))
    assert str(llm.runner.kv_dtype) == f"torch.{'float32' if kv_cache_dtype == 'auto' else kv_cache_dtype}"
    plan = llm.runner.linear_plan
    assert plan is not None and plan.batch_invariant
    assert all(n.startswith("cpp-") for names in plan.choices.values() for n in names)
    if quantization == "auto":  # the default GGUF's own formats, one numerics per class
        assert {n.rsplit("-", 1)[0] for n in plan.choices["gate_up"]} == {"cpp-q4_1"}
        assert {n.rsplit("-", 1)[0] for n in plan.choices["lm_head"]} == {"cpp-q8_0"}
    rec = _Recorder(llm)
    prompt = tokenizer.encode(PROMPT)
    assert len(prompt) > 32  # two full blocks of 16 to hit in the prefix cache
    others = [tokenizer.encode(t) for t in OTHERS]

    (alone,), (a,) = _run(llm, [prompt])
    # batched: other lengths, a 24-token budget chunks the prefills among decodes
    batched, reqs = _run(llm, [others[0], prompt, others[1], others[2]])
    b = reqs[1]
    # prefix hit: the prompt's first blocks are cached from the runs above
    (cached,), (c,) = _run(llm, [prompt])
    assert c.num_cached_tokens >= 32

    assert alone == batched[1] == cached, (alone, batched[1], cached)
    la, lb, lc = (torch.stack(rec.logits[r.request_id]) for r in (a, b, c))
    assert la.shape == (MAX_TOKENS, llm.runner.model.vocab_size)
    assert torch.equal(la, lb), float((la - lb).abs().max())
    assert torch.equal(la, lc), float((la - lc).abs().max())
