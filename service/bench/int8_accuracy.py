"""Accuracy of `--quantization int8` / `int4` against fp32 (the oracle), on real prompts and text.

    python -m service.bench.int8_accuracy                  # int8: 20 prompts x 64 tokens, perplexity
    python -m service.bench.int8_accuracy --mode int4 --json int4.json
    python -m service.bench.int8_accuracy --mode auto --kv-cache-dtype float16   # 16-bit K/V too

Measures, on the same loaded checkpoint (the quantized model's linear kernels chosen by
measurement on this machine, as the server does; the JSON records the choice):
- greedy agreement: 20 prompts (10 chat questions through the chat template, 10 text
  openings), 64 greedy tokens each from fp32 and from the mode: how many leading tokens are
  identical, and how many prompts agree over all 64;
- teacher-forced top-1 agreement: along fp32's greedy continuation, how often the mode's
  argmax is fp32's (per-step agreement, free of the compounding of one divergence);
- perplexity of both on about 2,600 tokens of English prose (service.bench.texts,
  written for Conveyor), computed through the engine's own chunked prefill, and the
  cosine similarity of the two models' logits at every position.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence

import torch

from protocol import SamplingParams
from service.config import (KV_CACHE_DTYPES, CacheConfig, EngineConfig, ModelConfig,
                            SchedulerConfig)
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from service.engine.llm import LLM
from service.worker.loader import LoadedModel, load_model
from service.worker.model_runner import ModelRunner


def make_runner(loaded: LoadedModel, quantization: str | None,
                num_kv_blocks: int = 1024, batch_invariant: bool = False,
                kv_cache_dtype: str = "auto", cpu_bf16_compute: str = "auto") -> ModelRunner:
    """A CPU runner over `loaded` with dense (None: the fp32 oracle), "int8", "int4" or
    "auto" linear layers, a KV cache of kv_cache_dtype (``--kv-cache-dtype``) and
    ``--cpu-bf16-compute`` cpu_bf16_compute."""
    cfg = EngineConfig(model=ModelConfig(quantization=quantization,
                                         batch_invariant=batch_invariant,
                                         cpu_bf16_compute=cpu_bf16_compute),
                       cache=CacheConfig(num_kv_blocks=num_kv_blocks, swap_space=0,
                                         kv_cache_dtype=kv_cache_dtype))
    return ModelRunner(cfg, loaded)


def greedy(runner: ModelRunner, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions (exactly max_tokens each, EOS ignored), all prompts batched."""
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=runner.num_blocks, swap_space=0),
                          scheduler=SchedulerConfig(max_num_seqs=len(prompts),
                                                    max_num_batched_tokens=512))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return LLM(config=config, runner=runner).generate(prompts, params)


@torch.inference_mode()
def all_logits(runner: ModelRunner, token_ids: Sequence[int], chunk: int = 256) -> torch.Tensor:
    """[N, V] float32 logits of every position of `token_ids`, through chunked prefill
    of one sequence (chunks of `chunk` tokens, every row sampled)."""
    blocks = list(range(runner.blocks_needed(len(token_ids))))
    if len(blocks) > runner.num_blocks:
        raise ValueError(f"{len(token_ids)} tokens need {len(blocks)} KV blocks, "
                         f"the runner has {runner.num_blocks}")
    rows = []
    for start in range(0, len(token_ids), chunk):
        ids = list(token_ids[start:start + chunk])
        seq = ScheduledSequence("text", ids, start, blocks, True, SamplingParams())
        input_ids, positions, meta, _ = runner.prepare_inputs(SchedulerOutput([seq], len(ids)))
        every_row = torch.arange(len(ids), device=runner.device)
        rows.append(runner.model.forward(input_ids, positions, meta, runner.kv_caches, every_row))
    return torch.cat(rows)


def perplexity(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp(mean NLL) of token_ids[1:] under logits[:-1] ([N, V] for N token ids)."""
    target = torch.tensor(token_ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
    return math.exp(float(nll))


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens of a and b are equal."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_set(loaded: LoadedModel, count: int = 20) -> list[list[int]]:
    """count/2 chat questions (chat template) and count/2 prose openings, as token ids."""
    from service.bench.texts import PASSAGES, QUESTIONS

    tok = loaded.tokenizer
    half = count // 2
    out = []
    for q in QUESTIONS[:half]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    for p in PASSAGES[:count - half]:
        out.append(tok.encode(p, add_special_tokens=False)[:24])
    return out


def measure(loaded: LoadedModel, *, num_prompts: int = 20, max_tokens: int = 64,
            mode: str = "int8", kv_cache_dtype: str = "auto") -> dict[str, object]:
    """All figures of the module docstring, fp32 vs `mode` ("int8" or "int4"; "none": dense
    fp32 too, to measure kv_cache_dtype alone) with its KV cache in kv_cache_dtype (the
    fp32 oracle's stays fp32)."""
    import platform

    from kernels.cpu_build import cpu_flags
    from service.bench.texts import PASSAGES
    from service.worker.quantization.paths import machine_note

    fp32 = make_runner(loaded, None)
    # the auto modes on a GGUF file serve its blocks, as `conveyor serve` does
    served = load_model(loaded.gguf_path, torch.float32, blocks=True) \
        if mode in ("auto", "auto-a8") and loaded.gguf_path is not None else loaded
    quant = make_runner(served, None if mode == "none" else mode, kv_cache_dtype=kv_cache_dtype)
    plan = quant.linear_plan
    prompts = prompt_set(loaded, num_prompts)
    ref = greedy(fp32, prompts, max_tokens)
    got = greedy(quant, prompts, max_tokens)
    lead = [leading_agreement(r, g) for r, g in zip(ref, got)]
    forced_agree = forced_total = 0
    for p, r in zip(prompts, ref):
        seq = list(p) + r[:-1]  # logits at these positions predict r
        a = all_logits(fp32, seq)[len(p) - 1:]
        b = all_logits(quant, seq)[len(p) - 1:]
        forced_agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        forced_total += a.shape[0]
    text = loaded.tokenizer.encode("\n\n".join(PASSAGES), add_special_tokens=False)
    la, lb = all_logits(fp32, text), all_logits(quant, text)
    cosine = torch.nn.functional.cosine_similarity(la, lb, dim=-1)
    flags = cpu_flags()
    return {
        "mode": mode, "kv_cache_dtype": str(quant.kv_dtype).removeprefix("torch."),
        "prompts": len(prompts), "max_tokens": max_tokens,
        "machine": {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "avx512": "avx512f" in flags, "vnni": machine_note(),
                    "processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads()},
        "linear_kernels": dict(plan.choices) if plan is not None else None,
        "greedy_identical_prompts": sum(n == max_tokens for n in lead),
        "greedy_leading_agreement_mean": statistics.fmean(lead),
        "greedy_leading_agreement_median": statistics.median(lead),
        "greedy_leading_agreement": lead,
        "teacher_forced_top1_agreement": forced_agree / forced_total,
        "text_tokens": len(text),
        "perplexity_fp32": perplexity(la, text), f"perplexity_{mode}": perplexity(lb, text),
        "logits_cosine_mean": float(cosine.mean()), "logits_cosine_min": float(cosine.min()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.bench.int8_accuracy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="int8",
                   choices=["int8", "int4", "auto", "auto-a8", "none"],
                   help="the --quantization to compare with fp32 (none: dense fp32, with "
                        "--kv-cache-dtype to measure the cache's dtype alone)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=KV_CACHE_DTYPES,
                   help="the compared runner's KV cache (the fp32 oracle's is float32)")
    p.add_argument("--prompts", type=int, default=20, metavar="N",
                   help="chat prompts whose greedy continuations are compared (default 20)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="greedy tokens per prompt (default 64)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the report (figures and the linear kernel plan) as JSON")
    a = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if a.prompts < 2 or a.max_tokens < 1:
        print("accuracy: --prompts must be >= 2 and --max-tokens >= 1", file=sys.stderr)
        return 2
    r = measure(load_model(None, torch.float32), num_prompts=a.prompts, max_tokens=a.max_tokens,
                mode=a.mode, kv_cache_dtype=a.kv_cache_dtype)
    print(f"{a.mode}, KV cache {r['kv_cache_dtype']}; "
          f"greedy, {r['prompts']} prompts x {r['max_tokens']} tokens: "
          f"{r['greedy_identical_prompts']} identical; leading agreement mean "
          f"{r['greedy_leading_agreement_mean']:.1f}, median {r['greedy_leading_agreement_median']}")
    print(f"teacher-forced top-1 agreement: {100 * r['teacher_forced_top1_agreement']:.1f}%")
    print(f"perplexity on {r['text_tokens']} tokens: fp32 {r['perplexity_fp32']:.3f}, "
          f"{a.mode} {r[f'perplexity_{a.mode}']:.3f}; logits cosine mean "
          f"{r['logits_cosine_mean']:.5f}, "
          f"min {r['logits_cosine_min']:.5f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
