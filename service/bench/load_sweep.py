"""`--load 0.5,0.7,0.9`: the batching modes under Poisson arrivals at fractions of
continuous batching's measured capacity, judged by goodput at an SLO.

Closed-loop throughput (every request sent at once) is not the regime a serving system
lives in; the seeds of the batching comparison are open-loop arrivals with a latency
target. One invocation:

1. closed loop: each mode of `--compare batching=...` runs the workload with every
   request sent at t = 0 (the usual comparison table and flat-step bound). Continuous
   batching's capacity C = its completed requests / run duration (requests/s).
2. open loop: for each fraction f, each mode runs the same requests on a fresh server,
   sent as a Poisson process of rate f x C (the same arrival times for every mode at a
   given f, from --seed).
3. per mode and load: goodput at the SLO (default TTFT <= 2 s and TPOT <= 200 ms), the
   requests/s and output tokens/s of requests that met every bound (DistServe, OSDI
   2024, section 2.2: goodput counts only SLO-meeting requests), SLO attainment, and
   TTFT / TPOT p99.

Also the closed-loop bound share: the measured continuous / static output tokens/s as
a share of the flat-step bound's ratio (`batching_bound.py`), e.g. measured 1.35x over a
bound of 1.14x -> 1.18 (118%: the bound leaves out static batching's lone first batch
and its unoverlapped prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from service.bench.metrics import Metrics, Slo

DEFAULT_LOAD_SLO = "ttft=2000,tpot=200"
SWEEP_FIGURES = ("goodput req/s", "goodput tok/s", "SLO met %", "TTFT p99 ms", "TPOT p99 ms")


def parse_fractions(text: str) -> tuple[float, ...]:
    """'0.5,0.7,0.9' -> (0.5, 0.7, 0.9). Raises ValueError (naming --load) for an empty,
    non-numeric, non-finite, repeated or non-positive fraction."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--load {text!r}: expected fractions of capacity, e.g. 0.5,0.7,0.9") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"--load {text!r}: every fraction must be a finite number > 0")
    if len(set(values)) != len(values):
        raise ValueError(f"--load {text!r}: a fraction is repeated")
    return values


def capacity(closed_loop: Metrics) -> float:
    """Requests/s that continuous batching completed in closed loop (completed requests /
    duration). Raises ValueError when a request failed or none completed: a capacity
    measured on a broken run would scale every later load wrongly."""
    if closed_loop.failed or not closed_loop.completed:
        raise ValueError(f"continuous batching's closed-loop run had {closed_loop.failed} "
                         f"failed of {closed_loop.num_requests} requests: no capacity to scale")
    return closed_loop.requests_per_s


def arrival_rates(capacity_rps: float, fractions: Sequence[float]) -> list[float]:
    """Poisson rates (requests/s) at each fraction of `capacity_rps`. E.g. capacity 0.6
    req/s, fractions (0.5, 0.9) -> [0.3, 0.54]. Raises ValueError for capacity <= 0."""
    if not (math.isfinite(capacity_rps) and capacity_rps > 0):
        raise ValueError(f"capacity must be > 0 requests/s, got {capacity_rps}")
    return [capacity_rps * f for f in fractions]


def load_label(mode_label: str, fraction: float) -> str:
    """'batching=static', 0.7 -> 'batching=static load=0.7'."""
    return f"{mode_label} load={fraction:g}"


def bound_share(continuous_tok_s: float | None, static_tok_s: float | None,
                bound_ratio: float | None) -> float | None:
    """(continuous / static measured output tokens/s) / the flat-step bound's ratio; None
    when a figure is missing or zero. E.g. 73.2 / 54.0 = 1.356 over 1.14 -> 1.19."""
    if not continuous_tok_s or not static_tok_s or not bound_ratio:
        return None
    return continuous_tok_s / static_tok_s / bound_ratio


@dataclass(frozen=True)
class SweepPoint:
    """One open-loop run: mode label, load fraction, Poisson rate (req/s), its metrics."""

    mode: str
    fraction: float
    rate_rps: float
    metrics: Metrics

    def figures(self) -> dict[str, float | None]:
        m = self.metrics
        return {"goodput req/s": m.goodput_requests_per_s,
                "goodput tok/s": m.goodput_output_tokens_per_s,
                "SLO met %": None if m.slo_attainment is None else 100.0 * m.slo_attainment,
                "TTFT p99 ms": m.ttft_ms.p99, "TPOT p99 ms": m.tpot_ms.p99}


def sweep_json(capacity_rps: float, slo: Slo, points: Sequence[SweepPoint],
               closed_loop_bound_share: float | None) -> dict[str, object]:
    """The `load_sweep` object of the JSON document."""
    return {"capacity_requests_per_s": capacity_rps,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms},
            "closed_loop_bound_share": closed_loop_bound_share,
            "points": [{"mode": p.mode, "fraction": p.fraction, "rate_requests_per_s": p.rate_rps,
                        "label": load_label(p.mode, p.fraction),
                        "output_tokens_per_s": p.metrics.output_tokens_per_s,
                        "failed": p.metrics.failed, **p.figures()} for p in points]}


def format_sweep(capacity_rps: float, slo: Slo, points: Sequence[SweepPoint],
                 closed_loop_bound_share: float | None) -> str:
    """A text table: one row per (mode, figure), one column per load fraction."""
    fractions = sorted({p.fraction for p in points})
    modes = list(dict.fromkeys(p.mode for p in points))
    at = {(p.mode, p.fraction): p for p in points}
    bounds = ", ".join(f"{k} <= {v:g} ms" for k, v in
                       (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
                       if v is not None)
    lines = [f"== load sweep: Poisson arrivals at fractions of continuous batching's closed-"
             f"loop capacity {capacity_rps:.3f} req/s; SLO {bounds} ==",
             f"  {'mode':<24}{'figure':<16}" + "".join(
                 f"{f:g} ({f * capacity_rps:.3f}/s)".rjust(18) for f in fractions)]
    for mode in modes:
        for name in SWEEP_FIGURES:
            cells = []
            for f in fractions:
                p = at.get((mode, f))
                v = None if p is None else p.figures()[name]
                cells.append(("-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}").rjust(18))
            lines.append(f"  {mode:<24}{name:<16}" + "".join(cells))
    if closed_loop_bound_share is not None:
        lines.append(f"  closed loop: continuous / static output tok/s = "
                     f"{100 * closed_loop_bound_share:.0f}% of the flat-step bound's ratio")
    return "\n".join(lines)
