"""The load of one invocation: requests, send times and limits, the same for every target."""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.bench.request_spec import RequestSpec

DEFAULT_REQUESTS_PER_CONNECTION = 64  # `conveyor serve --max-requests-per-connection` default


@dataclass(frozen=True)
class LoadPlan:
    """What every target (a Conveyor server, a peer) is given.

    requests: the workload; arrivals: send time of each, seconds from the start (same
        length, non-decreasing).
    max_concurrency: most requests in flight at once (None = no limit); a request due
        while the limit is reached waits, and its `sent_s` is when it was really sent.
    connections: WebSockets the requests are spread over, round robin (request i on
        socket i % connections).
    temperature: 0 = greedy. seed: per-request sampling seed base (request i gets
        seed + i) when temperature > 0, so sampled runs repeat; ignored when greedy.
    ignore_eos: force every completion to max_tokens (the checks then expect exactly that).
    timeout_s: a request without its done after this long is cancelled and failed.
    warmup: untimed short requests sent one by one before the run (first-step set-up).

    Raises ValueError for inconsistent or out-of-range values.
    """

    requests: tuple[RequestSpec, ...]
    arrivals: tuple[float, ...]
    max_concurrency: int | None = None
    connections: int = 1
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    warmup: int = 1

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a load plan needs at least one request")
        if len(self.arrivals) != len(self.requests):
            raise ValueError(f"{len(self.arrivals)} arrival times for {len(self.requests)} requests")
        if any(b < a for a, b in zip(self.arrivals, self.arrivals[1:])) or self.arrivals[0] < 0:
            raise ValueError("arrival times must be >= 0 and non-decreasing")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.connections < 1:
            raise ValueError(f"connections must be >= 1, got {self.connections}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")

    def params(self, spec: RequestSpec) -> dict[str, object]:
        """Sampling parameters of `spec` (keywords of `Client.generate`)."""
        params: dict[str, object] = {"max_tokens": spec.max_tokens,
                                     "temperature": self.temperature,
                                     "ignore_eos": self.ignore_eos}
        if self.temperature > 0:
            params["seed"] = self.seed + spec.index
        return params


def auto_connections(num_requests: int, max_concurrency: int | None,
                     per_connection: int = DEFAULT_REQUESTS_PER_CONNECTION) -> int:
    """Sockets needed so that no socket carries more than `per_connection` requests in
    flight (the server answers `too_many_requests` beyond its cap). E.g. 200 requests
    all at once -> 4 sockets; with max_concurrency 16 -> 1."""
    in_flight = min(num_requests, max_concurrency or num_requests)
    return max(1, math.ceil(in_flight / per_connection))
