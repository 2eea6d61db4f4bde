"""Scheduler overhead with a fake model runner: the Python cost of continuous batching.

    python -m service.bench.scheduler_overhead --num-seqs 256 --context 300 --steps 50

The real EngineCore (scheduler, KVBlockPool with prefix caching on) runs N
decoding requests; a NullRunner "samples" a fixed token for every sequence
instantly, so what is timed is what the engine adds to every step besides the
forward: `schedule()`, then `update_from_output` plus the stop checks and
finishing (EngineCore.step's own phases). The issue's budget: both together under 3% of a 15 ms step (0.45 ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from protocol import SamplingParams
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.core.engine_core import EngineCore
from service.core.null_runner import NullRunner
from service.core.request import Request

REFERENCE_STEP_MS = 15.0


def measure(num_seqs: int, context: int, steps: int, *, block_size: int = 16,
            warmup: int = 5) -> dict[str, float]:
    """Run `num_seqs` requests with `context`-token prompts to steady decoding, then time
    `steps` decode steps of EngineCore.step(). Returns medians in ms: schedule_ms,
    update_ms (update_from_output, stop checks, finishing), total_ms, the share of a
    15 ms step (percent_of_15ms).

    Raises ValueError for non-positive arguments; RuntimeError if a measured step did not
    run every sequence (the setup is sized so that it always does).
    """
    for name, v in (("num_seqs", num_seqs), ("context", context), ("steps", steps),
                    ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    total_tokens = context + steps + warmup + num_seqs * context // 256 + 16
    num_blocks = num_seqs * -(-total_tokens // block_size) + 8
    cache = CacheConfig(block_size=block_size, kv_watermark_low=1.0, kv_watermark_high=1.0,
                        kv_watermark_critical=1.0)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(512, num_seqs))
    runner = NullRunner(num_blocks, max_model_len=total_tokens + 1)
    core = EngineCore(EngineConfig(cache=cache, scheduler=config), runner)
    params = SamplingParams(temperature=0.0, max_tokens=total_tokens - context, ignore_eos=True)
    reqs = []
    for i in range(num_seqs):  # distinct prompts: no prefix sharing
        prompt = [(i * 7919 + j) % 49000 + 1 for j in range(context)]
        reqs.append(Request(f"r{i}", prompt, params, frozenset({0})))
        core.add_request(reqs[-1])
    while any(not r.output_token_ids for r in reqs):
        core.step()  # prefill
    for _ in range(warmup):
        core.step()
    sched_s, update_s = [], []
    for _ in range(steps):
        before = runner.tokens
        core.step()
        n = runner.tokens - before
        if n != num_seqs:
            raise RuntimeError(f"a measured step ran {n} of {num_seqs} sequences")
        times = core.last_step_times
        sched_s.append(times.schedule)
        update_s.append(times.update)
    core.check_integrity()
    schedule_ms = 1e3 * statistics.median(sched_s)
    update_ms = 1e3 * statistics.median(update_s)
    total = schedule_ms + update_ms
    return {"num_seqs": num_seqs, "context": context, "schedule_ms": schedule_ms,
            "update_ms": update_ms, "total_ms": total,
            "percent_of_15ms": 100.0 * total / REFERENCE_STEP_MS}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the overhead for each --num-seqs value. Returns 0, or 2 for bad arguments."""
    p = argparse.ArgumentParser(prog="python -m service.bench.scheduler_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--num-seqs", default="256", metavar="LIST",
                   help="comma-separated running sequence counts")
    p.add_argument("--context", type=int, default=300, metavar="TOKENS")
    p.add_argument("--steps", type=int, default=50, metavar="N")
    a = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        counts = [int(x) for x in a.num_seqs.split(",") if x.strip()]
        results = [measure(n, a.context, a.steps) for n in counts]
    except ValueError as e:
        print(f"scheduler overhead: {e}", file=sys.stderr)
        return 2
    print(f"{'seqs':>6} {'schedule ms':>12} {'update ms':>10} {'total ms':>9} {'% of 15 ms':>11}")
    for r in results:
        print(f"{r['num_seqs']:>6} {r['schedule_ms']:>12.3f} {r['update_ms']:>10.3f} "
              f"{r['total_ms']:>9.3f} {r['percent_of_15ms']:>10.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
