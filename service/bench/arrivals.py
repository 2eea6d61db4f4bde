"""When each request is sent: all at once, or a Poisson / gamma arrival process.

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean 1/`request_rate`
(scale = 1 / (rate * burstiness)), the convention of vLLM's serving benchmark:
burstiness 1 is a Poisson process (exponential gaps); below 1 arrivals come in bursts
separated by lulls; above 1 they are more evenly spaced than Poisson. The first request
is sent at t = 0.
"""

from __future__ import annotations

import math
import random


def arrival_times(n: int, request_rate: float = math.inf, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times in seconds from the start of the run, [n], non-decreasing, times[0] == 0.

    request_rate: requests per second (> 0); inf sends everything at t = 0.
    burstiness: gamma shape (> 0); 1.0 is Poisson.
    seed: the same seed gives the same times.

    Raises ValueError for n < 0, request_rate <= 0 or burstiness <= 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times: list[float] = []
    t = 0.0
    for i in range(n):
        if i > 0:
            t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times
