"""Engine-only benchmark: the step loop without a socket, every millisecond accounted for.

    python -m service.bench.engine_only                       # fp32, decode 1/16/64, prefill 512
    python -m service.bench.engine_only --quantization none,int8 --rounds 3 --json out.json

Drives EngineCore.step (schedule -> execute -> update -> stop checks) and the
detokenizer the way the engine's step loop does (then detokenize and encode each
request's delta frame), synchronously, in one thread. Scenarios:

- decode-N: N running sequences, each with a context of about --context tokens,
  one token each per step (their prompts are prefilled first, untimed);
- prefill-P: each step is the whole prefill of a new P-token prompt.

Each step is split into schedule / build_batch (block ops and metadata) / linear /
attention (K/V store included) / other (the rest of the forward) / sample /
update (scheduler output processing) / detokenize+stream. Variants (quantization x
decode kernel x batch invariance x fused decode x KV cache dtype x threads) are interleaved round by round so that they see the same machine load;
figures are medians over rounds of each run's median step (sections: means).
Prompts are real English (service.bench.texts), different for every sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence

import torch

from service.bench.bandwidth import bound_fraction, bound_ms, decode_weight_bytes, read_bandwidth
from service.bench.cpu_hog import CpuHog
from service.bench.engine_runs import (SECTIONS, RunStats, Scenario, DecodeRun, PrefillRun,
                                       text_tokens, summarize)
from service.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, ModelConfig
from service.gc_heap import freeze_startup_heap
from service.worker.cpu_threads import default_num_threads
from service.worker.loader import LoadedModel, load_model
from service.worker.model_runner import ModelRunner
from service.worker.quantization.paths import machine_note
from service.worker.thread_tuner import ThreadTuner

OMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor bench --engine-only",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quantization", default="auto", metavar="LIST",
                   help="comma-separated variants among none, int8, int4, auto, auto-a8 (e.g. "
                        "none,int4,auto; default: auto, what `conveyor serve` runs)")
    p.add_argument("--batch-invariant", default="off", metavar="LIST",
                   help="comma-separated variants among off, on (e.g. off,on to measure what "
                        "--batch-invariant costs)")
    p.add_argument("--cpu-decode-kernel", default="auto", metavar="LIST",
                   help="comma-separated decode attention kernels among auto, cpp, sdpa "
                        "(e.g. cpp,sdpa to compare them side by side)")
    p.add_argument("--cpu-fused-decode", default="auto", metavar="LIST",
                   help="comma-separated settings among auto, off (e.g. auto,off: decode steps "
                        "as one native call against one call per op)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="LIST",
                   help="comma-separated KV cache dtypes among auto, float32, float16, "
                        "bfloat16 (e.g. auto,float16: what a 16-bit cache buys)")
    p.add_argument("--cpu-bf16-compute", default="auto", metavar="LIST",
                   help="comma-separated settings among auto, off (e.g. off,auto: the exact "
                        "paths against 16-bit compute for many-row calls, side by side)")
    p.add_argument("--threads", default=None, metavar="LIST",
                   help="comma-separated torch thread counts to compare, and `auto` for the "
                        "adaptive thread tuner (default: the CPUs, affinity and quota)")
    p.add_argument("--decode-seqs", default="1,16,64", metavar="LIST",
                   help="running sequences of the decode scenarios ('' for none)")
    p.add_argument("--context", type=int, default=300, metavar="TOKENS",
                   help="context length of the decoding sequences (about)")
    p.add_argument("--prefill-len", type=int, default=512, metavar="TOKENS",
                   help="prompt length of the prefill scenario (0 for none)")
    p.add_argument("--steps", type=int, default=8, metavar="N",
                   help="measured decode steps per scenario and round")
    p.add_argument("--prefill-steps", type=int, default=2, metavar="N",
                   help="measured prefills per round")
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="rounds; the variants take turns within each round")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps per scenario")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV block")
    p.add_argument("--cpu-hog", type=int, default=0, metavar="N",
                   help="busy processes (`yes > /dev/null`) started for the measurement and "
                        "stopped after it: the engine under a noisy neighbour")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--{name} values must be >= 1, got {text!r}")
    return values


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace,
                                          list[tuple[str | None, str, bool, str, str, str]],
                                          list[int | str], list[Scenario]]:
    a = build_parser().parse_args(list(argv))
    quants: list[str | None] = []
    for q in a.quantization.split(","):
        if q.strip() not in ("none", "int8", "int4", "auto", "auto-a8"):
            raise ValueError(f"--quantization values must be none, int8, int4, auto or auto-a8, "
                             f"got {q!r}")
        quants.append(None if q.strip() == "none" else q.strip())
    kernels = [k.strip() for k in a.cpu_decode_kernel.split(",")]
    if any(k not in ("auto", "cpp", "sdpa") for k in kernels) or len(set(kernels)) < len(kernels):
        raise ValueError(f"--cpu-decode-kernel values must be distinct among auto, cpp, sdpa, "
                         f"got {a.cpu_decode_kernel!r}")
    if "auto" in kernels and len(kernels) > 1:  # auto is cpp or sdpa: it would repeat one
        raise ValueError("--cpu-decode-kernel auto cannot be listed with cpp or sdpa")
    invariant = [b.strip() for b in a.batch_invariant.split(",")]
    if any(b not in ("off", "on") for b in invariant) or len(set(invariant)) < len(invariant):
        raise ValueError(f"--batch-invariant values must be distinct among off, on, got "
                         f"{a.batch_invariant!r}")
    fused = [f.strip() for f in a.cpu_fused_decode.split(",")]
    if any(f not in ("auto", "on", "off") for f in fused) or len(set(fused)) < len(fused):
        raise ValueError(f"--cpu-fused-decode values must be distinct among auto, on, off, "
                         f"got {a.cpu_fused_decode!r}")
    kv_dtypes = [d.strip() for d in a.kv_cache_dtype.split(",")]
    if (any(d not in KV_CACHE_DTYPES for d in kv_dtypes)
            or len(set(kv_dtypes)) < len(kv_dtypes)):
        raise ValueError(f"--kv-cache-dtype values must be distinct among "
                         f"{', '.join(KV_CACHE_DTYPES)}, got {a.kv_cache_dtype!r}")
    bf16 = [b.strip() for b in a.cpu_bf16_compute.split(",")]
    if any(b not in ("auto", "on", "off") for b in bf16) or len(set(bf16)) < len(bf16):
        raise ValueError(f"--cpu-bf16-compute values must be distinct among auto, on, off, got "
                         f"{a.cpu_bf16_compute!r}")
    models = [(q, k, b == "on", f, d, h) for q in quants for k in kernels for b in invariant
              for f in fused for d in kv_dtypes for h in bf16]
    threads: list[int | str] = [default_num_threads()]
    if a.threads:
        auto = [t.strip() for t in a.threads.split(",")].count("auto")
        rest = ",".join(t for t in a.threads.split(",") if t.strip() != "auto")
        threads = [*_int_list(rest, "threads"), *["auto"] * min(auto, 1)]
        if not threads:
            raise ValueError("--threads: no thread count given")
    for name in ("context", "steps", "prefill_steps", "rounds"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or a.prefill_len < 0 or a.cpu_hog < 0:
        raise ValueError("--warmup, --prefill-len and --cpu-hog must be >= 0")
    scenarios = [Scenario("decode", n, a.context) for n in _int_list(a.decode_seqs, "decode-seqs")]
    if a.prefill_len:
        scenarios.append(Scenario("prefill", 1, a.prefill_len))
    if not scenarios:
        raise ValueError("no scenario: give --decode-seqs or --prefill-len")
    return a, models, threads, scenarios


def _format(results: dict[str, dict[str, dict[str, object]]]) -> str:
    widths = [max(12, len(s)) for s in SECTIONS]
    vw = max([14] + [len(v) for by_v in results.values() for v in by_v])
    head = (f"{'scenario':<12} {'variant':<{vw}} {'tok/s':>8} {'steps/s':>8} {'ms/step':>8} |"
            + "".join(f" {s:>{w}}" for s, w in zip(SECTIONS, widths)))
    lines = [head, "-" * len(head)]
    for scenario, by_variant in results.items():
        for variant, r in by_variant.items():
            sec = r["sections_ms_mean"]
            assert isinstance(sec, dict)
            lines.append(f"{scenario:<12} {variant:<{vw}} {r['tokens_per_s']:>8.1f} "
                         f"{r['steps_per_s']:>8.2f} {r['ms_per_step_median']:>8.2f} |"
                         + "".join(f" {sec[s]:>{w}.3f}" for s, w in zip(SECTIONS, widths)))
    return "\n".join(lines)


def run(argv: Sequence[str], loaded: LoadedModel | None = None,
        freeze_heap: bool = False) -> dict[str, object]:
    """Run the benchmark; returns the report (also printed). `loaded`: a checkpoint already
    in memory (else --model is loaded); `freeze_heap`: freeze the heap once every runner is
    built, as a serving process does (service/gc_heap.py; the CLI's own process only).
    Raises ValueError for bad arguments."""
    a, models, threads, scenarios = _parse(argv)
    load_before = os.getloadavg()
    # the auto modes serve a GGUF file's own blocks (as `conveyor serve` does); the others
    # need dense fp32 weights, read only if a variant asks for them
    given = loaded
    blocks_loaded: LoadedModel | None = None
    dense_loaded = loaded

    def loaded_for(q: str | None) -> LoadedModel:
        nonlocal blocks_loaded, dense_loaded
        if q in ("auto", "auto-a8") and given is None:
            blocks_loaded = blocks_loaded or load_model(a.model, torch.float32, blocks=True)
            return blocks_loaded
        dense_loaded = dense_loaded or load_model(a.model, torch.float32)
        return dense_loaded

    loaded = loaded_for(models[0][0])
    variants = [(m, t) for m in models for t in threads]
    # Thread variants of one model variant share its runner and its decode state.
    decode_steps = a.warmup + a.steps * a.rounds * len(threads) + 8
    blocks = 8 + max(-(-(sc.context + decode_steps + (sc.num_seqs * sc.context) // 256)
                       // a.block_size) * sc.num_seqs for sc in scenarios)
    tokens = text_tokens(loaded, 4 * max(sc.context for sc in scenarios))
    runners: dict[tuple[str | None, str, bool, str, str, str], ModelRunner] = {}
    for q, k, bi, f, d, h in models:
        cfg = EngineConfig(model=ModelConfig(model=a.model, quantization=q, cpu_decode_kernel=k,
                                             batch_invariant=bi, adaptive_threads=False,
                                             cpu_fused_decode=f, cpu_bf16_compute=h),
                           cache=CacheConfig(block_size=a.block_size, num_kv_blocks=blocks,
                                             swap_space=0, kv_cache_dtype=d))
        runners[(q, k, bi, f, d, h)] = ModelRunner(cfg, loaded_for(q))
    if freeze_heap:
        freeze_startup_heap("engine-only bench")

    def label(m: tuple[str | None, str, bool, str, str, str], t: int | str) -> str:
        # e.g. "int8/cpp/2t", "fp32/cpp/inv/auto", "int4/cpp/unfused/2t", "auto/cpp/kv16/2t";
        # the kernel is the one "auto" resolved to; "unfused": --cpu-fused-decode off (where
        # the default fused decode steps is in the report's "fused_decode"); kv16 / kvbf16:
        # a float16 / bfloat16 KV cache; "exact": --cpu-bf16-compute off
        kv = {"float16": "/kv16", "bfloat16": "/kvbf16", "float32": "/kv32"}.get(m[4], "")
        kv += "/exact" if m[5] == "off" else ""
        return (f"{m[0] or 'fp32'}/{runners[m].decode_kernel}{'/inv' if m[2] else ''}"
                f"{'/unfused' if m[3] == 'off' else ''}{kv}/{t}{'t' if t != 'auto' else ''}")

    tuning: dict[str, dict[str, list]] = {}

    stats: dict[str, dict[str, list[RunStats]]] = {sc.name: {label(*v): [] for v in variants}
                                                   for sc in scenarios}
    bw_threads = threads[0] if isinstance(threads[0], int) else default_num_threads()
    torch.set_num_threads(bw_threads)
    before = read_bandwidth()
    bandwidth = {"threads": bw_threads, "before_gb_s": before.best_gb_s,
                 "before_median_gb_s": before.median_gb_s}
    with CpuHog(a.cpu_hog):  # the neighbours run for the whole measurement, then stop
        for sc in scenarios:
            live: dict[tuple[str | None, str, bool, str], DecodeRun | PrefillRun] = {}
            # "auto": one tuner per model variant and scenario, kept across the rounds; it
            # also runs the untimed prefill and warm-up steps (its start-up probe)
            tuners = {m: ThreadTuner(default_num_threads()) for m in models}
            for m in models:
                runners[m].thread_tuner = tuners[m] if "auto" in threads else None
                torch.set_num_threads(tuners[m].current if "auto" in threads else threads[0])
                live[m] = (DecodeRun(runners[m], tokens, sc, a.steps * len(threads), a.rounds,
                                      a.warmup) if sc.kind == "decode"
                           else PrefillRun(runners[m], tokens, sc, a.warmup))
            steps = a.steps if sc.kind == "decode" else a.prefill_steps
            for _ in range(a.rounds):
                for m, t in variants:
                    runners[m].thread_tuner = tuners[m] if t == "auto" else None
                    torch.set_num_threads(tuners[m].current if t == "auto" else t)
                    stats[sc.name][label(m, t)].append(live[m].measure(steps))
            if "auto" in threads:
                tuning[sc.name] = {label(m, "auto"): [list(h) for h in tuners[m].history]
                                   for m in models}
            for run_ in live.values():
                run_.close()
    results = {name: {v: summarize(runs) for v, runs in by_v.items()}
               for name, by_v in stats.items()}
    torch.set_num_threads(bw_threads)
    after = read_bandwidth()
    bandwidth["after_gb_s"], bandwidth["after_median_gb_s"] = after.best_gb_s, after.median_gb_s
    bound = _bandwidth_bound(results, {label(m, t): runners[m] for m, t in variants}, bandwidth)
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "isa": machine_note(),
                    "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "cpu_hogs": a.cpu_hog,
                    "omp_env": {k: os.environ.get(k) for k in OMP_ENV},
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "linear_paths_env": os.environ.get("CONVEYOR_LINEAR_PATHS"),
        "linear_kernels": {label(m, threads[0]): (runners[m].linear_plan.summary()
                                                  if runners[m].linear_plan else "fp32 F.linear")
                           for m in models},
        "fused_decode": {label(m, threads[0]): runners[m].fused_decode for m in models},
        "results": results,
        "read_bandwidth": {**bandwidth, "method": "torch x.sum() over 256 MiB float32, best and "
                                                  "median of 10, before and after the runs"},
        "decode_1_bandwidth_bound": bound,
        "thread_tuning": tuning,  # "auto" variants: (time s, from, to, time ratio) decisions
    }
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"(1 min); torch {torch.__version__}; {len(os.sched_getaffinity(0))} cores "
          f"({torch.backends.cpu.get_cpu_capability()}; {machine_note()}); {a.cpu_hog} CPU "
          "hog(s); " + ", ".join(f"{k}={os.environ.get(k, '-')}" for k in OMP_ENV))
    for m in models:
        if runners[m].linear_plan is not None:
            print(f"{label(m, threads[0])}: {runners[m].linear_plan.summary()}")
    print(_format(results))
    print("tok/s, steps/s, ms/step: median over rounds of each round's median step; "
          "sections: mean ms per step")
    for variant, b in bound.items():
        print(f"decode-1 {variant}: {b['weight_bytes_per_step'] / 1e6:.1f} MB of weights a step; "
              f"read bandwidth {bandwidth['before_gb_s']:.1f} GB/s before, "
              f"{bandwidth['after_gb_s']:.1f} after (best of 10; medians "
              f"{bandwidth['before_median_gb_s']:.1f}, {bandwidth['after_median_gb_s']:.1f}); "
              f"bound {b['bound_ms']:.2f} ms at the higher best; "
              f"{b['ms_per_step']:.2f} ms a step = {100 * b['fraction_of_bound']:.0f}% of it "
              f"({100 * b['fraction_of_bound_at_median']:.0f}% of the bound at the higher "
              "median)")
    return report


def _bandwidth_bound(results: dict[str, dict[str, dict[str, object]]],
                     runners: dict[str, ModelRunner],
                     bandwidth: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per variant of the decode-1 scenario: the weight bytes a step reads, the bound
    (bytes / the higher of the two best-of-10 bandwidths: the stricter bound) and the
    fraction of it the median step reaches; the same at the higher of the two medians
    (service/bench/bandwidth.py)."""
    gb_s = max(bandwidth["before_gb_s"], bandwidth["after_gb_s"])
    median_gb_s = max(bandwidth["before_median_gb_s"], bandwidth["after_median_gb_s"])
    out = {}
    for variant, r in results.get("decode-1", {}).items():
        wb = decode_weight_bytes(runners[variant].model)
        ms = float(r["ms_per_step_median"])  # type: ignore[arg-type]
        out[variant] = {"weight_bytes_per_step": wb, "read_gb_s": gb_s,
                        "bound_ms": bound_ms(wb, gb_s), "ms_per_step": ms,
                        "fraction_of_bound": bound_fraction(ms, wb, gb_s),
                        "median_read_gb_s": median_gb_s,
                        "bound_ms_at_median": bound_ms(wb, median_gb_s),
                        "fraction_of_bound_at_median": bound_fraction(ms, wb, median_gb_s)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (`scripts/bench --engine-only ...`). Returns 0, or 2 for bad arguments."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        report = run(argv, freeze_heap=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"engine-only bench: {e}", file=sys.stderr)
        return 2
    path = build_parser().parse_args(list(argv)).json
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"engine-only bench: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
