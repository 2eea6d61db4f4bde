"""Prefill of one long prompt in the engine's chunks: attention's share of each chunk's step.

    python -m service.bench.long_prefill                 # 6,000 tokens, chunks of 512, 2 rounds
    python -m service.bench.long_prefill --prompt-len 6000 --variants cpp-bf16,cpp,sdpa \\
        --rounds 2 --json out.json

Drives EngineCore.step (`service.bench.engine_runs.Workload`) over one fresh prompt of
--prompt-len tokens of real text with the default token budget (max_num_batched_tokens 512:
chunked prefill, one chunk a step), in the default mode (quantization auto, fp32 KV cache),
and times each step's sections with the runner's SectionTimer: per chunk, the step's wall
time, its attention (the attention op, K/V store included) and linear layers. Variants of
the prefill attention:

- cpp-bf16: the C++ kernel with bf16 products for chunks whose context reaches
  ``BF16_DOT_MIN_CONTEXT`` (what the default runs where the CPU has AVX512-BF16);
- cpp: the C++ kernel with fp32 products for every chunk;
- sdpa: gathered K/V and torch's scaled_dot_product_attention (--cpu-decode-kernel sdpa).

Variants take turns within each round (the same machine load); per chunk, the figures are
medians over the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from service.bench.engine_runs import Workload, text_tokens
from service.config import CacheConfig, EngineConfig, ModelConfig
from service.worker.loader import LoadedModel, load_model
from service.worker.model_runner import ModelRunner
from service.worker.quantization.paths import machine_note

VARIANTS = ("cpp-bf16", "cpp", "sdpa")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m service.bench.long_prefill",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-len", type=int, default=6000, metavar="TOKENS")
    p.add_argument("--chunk", type=int, default=512, metavar="TOKENS",
                   help="max_num_batched_tokens (the default's 512: one chunk a step)")
    p.add_argument("--variants", default="cpp-bf16,cpp,sdpa", metavar="LIST",
                   help=f"comma-separated among {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=2, metavar="N")
    p.add_argument("--json", default=None, metavar="PATH")
    return p


def _runner(loaded, variant: str, num_blocks: int) -> ModelRunner:
    cfg = EngineConfig(model=ModelConfig(cpu_decode_kernel="sdpa" if variant == "sdpa" else "cpp",
                                         adaptive_threads=False),
                       cache=CacheConfig(num_kv_blocks=num_blocks, swap_space=0))
    runner = ModelRunner(cfg, loaded)
    layout = runner.ops.plan_step.args[0]  # the torch backend's plan: partial(plan, layout)
    if variant == "cpp-bf16" and not layout.prefill_bf16_dot:
        raise ValueError("cpp-bf16: the default mode does not use bf16 products here (no "
                         "AVX512-BF16, or an ISA cap hides it)")
    if variant == "cpp" and layout.prefill_bf16_dot:  # the fp32 products for comparison
        runner.ops = dataclasses.replace(runner.ops, plan_step=functools.partial(
            runner.ops.plan_step.func, dataclasses.replace(layout, prefill_bf16_dot=False)))
    return runner


def cpu_class() -> str:
    """The CPU's model name, family and model from /proc/cpuinfo (e.g. "AMD EPYC, family 25
    model 17"), or the platform's processor name where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return (f"{fields.get('model name', '?')}, family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}")


def _prefill_attention(runner: ModelRunner) -> str:
    """What serves the prefill chunks: "cpp-bf16", "cpp" or "sdpa" (the plan's layout)."""
    if runner.decode_kernel != "cpp":
        return runner.decode_kernel
    return "cpp-bf16" if runner.ops.plan_step.args[0].prefill_bf16_dot else "cpp"


def _prefill(wl: Workload, prompt_len: int) -> list[dict[str, float]]:
    """One prompt's prefill, a chunk a step: per chunk its context and sections (ms)."""
    wl.add(prompt_len, 1)
    chunks = []
    done = 0
    with wl.timed():
        while wl.sched.has_unfinished():
            timer = wl.runner.timer
            timer.seconds = {}
            t0 = time.perf_counter()
            wl.core.step()
            total = time.perf_counter() - t0
            n = wl.core.last_num_batched_tokens
            done += n
            sec = {k: 1e3 * v for k, v in timer.seconds.items()}
            chunks.append({"tokens": n, "context": done, "step_ms": 1e3 * total,
                           "attention_ms": sec.get("attention", 0.0),
                           "linear_ms": sec.get("linear", 0.0)})
    wl.finish_all()
    if done != prompt_len:
        raise RuntimeError(f"prefilled {done} of {prompt_len} tokens")
    return chunks


def run(argv: Sequence[str], loaded: LoadedModel | None = None) -> dict[str, object]:
    """The benchmark with `argv`'s arguments (`loaded`: a GGUF model already loaded in its
    blocks, else --model is loaded). Returns the report; raises ValueError for bad
    arguments."""
    a = build_parser().parse_args(list(argv))
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"--variants must be among {VARIANTS}, got {a.variants!r}")
    load_before = os.getloadavg()
    loaded = loaded or load_model(a.model, torch.float32, blocks=True)
    tokens = text_tokens(loaded, 2 * a.prompt_len)
    num_blocks = -(-a.prompt_len // 16) + 8
    workloads = {v: Workload(_runner(loaded, v, num_blocks), tokens, 1, token_budget=a.chunk)
                 for v in variants}
    for wl in workloads.values():  # warm-up: one short prompt each (kernel builds, plans)
        _prefill(wl, min(a.prompt_len, 2 * a.chunk))
    runs: dict[str, list[list[dict[str, float]]]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            runs[v].append(_prefill(workloads[v], a.prompt_len))
    results = {}
    for v in variants:
        per_chunk = []
        for i, first in enumerate(runs[v][0]):
            med = {k: statistics.median(r[i][k] for r in runs[v])
                   for k in ("step_ms", "attention_ms", "linear_ms")}
            per_chunk.append({"tokens": first["tokens"], "context": first["context"], **{
                k: round(x, 1) for k, x in med.items()},
                "attention_share": round(med["attention_ms"] / med["step_ms"], 3)})
        total = sum(c["step_ms"] for c in per_chunk)
        attention = sum(c["attention_ms"] for c in per_chunk)
        results[v] = {"chunks": per_chunk, "prefill_s": round(total / 1e3, 2),
                      "attention_s": round(attention / 1e3, 2),
                      "attention_share": round(attention / total, 3),
                      "prefill_attention": _prefill_attention(workloads[v].runner)}
    report = {
        "benchmark": "python -m service.bench.long_prefill " + " ".join(argv),
        "machine": {"cpu": cpu_class(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "isa": machine_note(), "threads": torch.get_num_threads(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "linear_kernels": workloads[variants[0]].runner.describe()["linear_kernels"],
        "results": results,
        "method": "per chunk: median over rounds of the step's wall time and of its attention "
                  "and linear sections (SectionTimer); attention includes the K/V store",
    }
    for v in variants:
        r = results[v]
        print(f"{v} ({r['prefill_attention']}): prefill {r['prefill_s']} s, attention "
              f"{r['attention_s']} s ({100 * r['attention_share']:.1f}%)")
        print("  chunk context: step ms / attention ms (share): " + "; ".join(
            f"{c['context']}: {c['step_ms']:.0f}/{c['attention_ms']:.0f} "
            f"({100 * c['attention_share']:.0f}%)" for c in r["chunks"]))
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{torch.get_num_threads()} threads; {machine_note()}")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    report = run(args)
    path = build_parser().parse_args(args).json
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
