"""TTFT of long prompts one after another on a fresh engine: is the first as fast as the tenth?

    python -m service.bench.long_prompts --model M.gguf --prompt-tokens 2000 --prompts 10 \
        --cpu-bf16-compute off,auto --bucket-warmup on,off --json out.json

Per variant (--cpu-bf16-compute x --bucket-warmup), one model load shared: a fresh runner,
the engine's start-up measurement and warm-up (``ModelRunner.measure_rates``, as
``Engine.start`` runs before ``ready``; ``--bucket-warmup off`` leaves out its warm-up of the
row buckets, ``_warm_buckets``, to show what it buys), then --prompts requests in a row,
each a different --prompt-tokens-token prompt of English prose (no prefix-cache hit between
them) with max_tokens 1: TTFT is the request's prefill (chunks of max_num_batched_tokens)
and its first sample, through ``LLM.generate`` in this process (no socket). Variants run one
after another (a first prompt cannot be interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from protocol import SamplingParams
from service.bench.engine_runs import text_tokens
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.engine.llm import LLM
from service.worker.loader import load_model
from service.worker.model_runner import ModelRunner
from service.worker.quantization.paths import machine_note


def _ttfts(loaded, model: str | None, bf16: str, warm: bool, prompt_tokens: int, prompts: int,
           batched: int) -> dict[str, object]:
    config = EngineConfig(model=ModelConfig(model=model, cpu_bf16_compute=bf16,
                                            adaptive_threads=False),
                          cache=CacheConfig(kv_cache_memory=1 << 30, swap_space=0,
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=batched))
    start = time.perf_counter()
    runner = ModelRunner(config, loaded)
    runner.measure_rates(buckets=warm)
    ready_s = time.perf_counter() - start
    llm = LLM(config=config, runner=runner)
    text = text_tokens(loaded, prompt_tokens + 13 * prompts)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    for i in range(prompts):
        ids = text[13 * i:13 * i + prompt_tokens]  # a different first block each time
        t = time.perf_counter()
        llm.generate([ids], params)
        out.append(time.perf_counter() - t)
    plan = runner.linear_plan
    runner.release()
    return {"start_to_ready_s": ready_s, "ttft_s": out, "first_s": out[0],
            "last_s": out[-1], "median_s": statistics.median(out),
            "linear_kernels": plan.summary() if plan is not None else "fp32 F.linear"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.bench.long_prompts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="PATH")
    p.add_argument("--prompt-tokens", type=int, default=2000, metavar="N")
    p.add_argument("--prompts", type=int, default=10, metavar="N")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N")
    p.add_argument("--cpu-bf16-compute", default="off,auto", metavar="LIST")
    p.add_argument("--bucket-warmup", default="on", metavar="LIST",
                   help="comma list among on, off (off: the start-up without _warm_buckets)")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if a.prompt_tokens < 1 or a.prompts < 1:
        print("long_prompts: --prompt-tokens and --prompts must be >= 1", file=sys.stderr)
        return 2
    loaded = load_model(a.model, torch.float32, blocks=True)
    load_before = os.getloadavg()
    results = {}
    for bf16 in a.cpu_bf16_compute.split(","):
        for warm in a.bucket_warmup.split(","):
            key = f"bf16-{bf16.strip()}/warmup-{warm.strip()}"
            r = _ttfts(loaded, a.model, bf16.strip(), warm.strip() == "on", a.prompt_tokens,
                       a.prompts, a.max_num_batched_tokens)
            results[key] = r
            print(f"{key}: ready in {r['start_to_ready_s']:.1f} s; TTFT first "
                  f"{r['first_s']:.2f} s, last ({a.prompts}th) {r['last_s']:.2f} s, median "
                  f"{r['median_s']:.2f} s ({a.prompt_tokens} tokens); {r['linear_kernels']}",
                  flush=True)
    report = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "isa": machine_note(), "threads": torch.get_num_threads(),
                          "load_average_before": load_before,
                          "load_average_after": os.getloadavg()},
              "settings": vars(a), "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
