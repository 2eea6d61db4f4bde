"""Summary statistics of latency samples: mean, median, p90, p99, max.

Percentiles interpolate linearly between the two nearest ranks (Hyndman and Fan's
definition 7, numpy's default): for sorted samples x[0..n-1] and q in [0, 100],

    h = (n - 1) * q / 100,  p_q = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])

E.g. x = [1, 2, 3, 4], q = 90: h = 2.7, p90 = 3 + 0.7 * (4 - 3) = 3.7.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, linear interpolation (see above).

    Raises ValueError for no values, a NaN among them, or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if any(math.isnan(x) for x in xs):
        raise ValueError("percentile of values containing NaN")
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Summary:
    """count samples; mean, median, p90, p99, max in the samples' unit (None when count is 0)."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        """Summary of `values` (may be empty). Raises ValueError for a NaN."""
        if not values:
            return cls(0, None, None, None, None, None)
        return cls(len(values), math.fsum(values) / len(values), percentile(values, 50),
                   percentile(values, 90), percentile(values, 99), max(values))
