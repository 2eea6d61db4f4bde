"""The figures of one run: latency summaries, throughput, goodput under an SLO, failures.

Throughput divides by the run's duration: from its start (the first request's scheduled
send time, t = 0) to the last done. Goodput counts completed requests whose TTFT, TPOT
and E2E meet every bound the SLO sets (DistServe, OSDI 2024, defines goodput so); a
request with one output token has no TPOT and meets any TPOT bound. Only completed
requests (`RequestRecord.ok`) enter the latency summaries and the throughput.

`short_e2e_ms` is the E2E latency of the "short" requests: those asking for at most the
run's median `max_tokens` (the lower median). On seed-exercise these are the 8 requests
of 100 tokens beside the 2 of 1000: how long a short request waits behind long ones is
what static batching costs and continuous batching saves (Orca, OSDI 2022, section 2).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from service.bench.record import RequestRecord
from service.bench.stats import Summary

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Slo:
    """Latency bounds in milliseconds; None = unbounded."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft=500,tpot=50' (any of ttft, tpot, e2e; milliseconds > 0) -> Slo.

        Raises ValueError for an unknown key, a repeated key, or a value that is not > 0.
        """
        bounds: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"SLO part {part!r}: expected KEY=MS with KEY in {', '.join(SLO_KEYS)}")
            if key in bounds:
                raise ValueError(f"SLO key {key!r} given twice")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"SLO {key}: {value!r} is not a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
            bounds[key] = ms
        return cls(**{f"{k}_ms": v for k, v in bounds.items()})

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, r: RequestRecord) -> bool:
        """Whether completed request `r` meets every bound."""
        if not r.ok:
            return False
        for bound, value in ((self.ttft_ms, r.ttft_ms), (self.tpot_ms, r.tpot_ms),
                             (self.e2e_ms, r.e2e_ms)):
            if bound is not None and value is not None and value > bound:
                return False
        return True


@dataclass(frozen=True)
class Metrics:
    """Figures of one run. Latencies in ms, rates per second of run duration.

    goodput_requests_per_s, goodput_output_tokens_per_s (output tokens of the requests that
    met the SLO, per second) and slo_attainment (fraction of all requests meeting the SLO)
    are None when no SLO was given. ttft_gap_ms: client TTFT minus the engine's TTFT.
    short_e2e_ms: E2E of requests with max_tokens <= the run's lower median (module doc).
    """

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float | None
    goodput_output_tokens_per_s: float | None
    slo_attainment: float | None
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    short_e2e_ms: Summary
    engine_queue_ms: Summary
    engine_ttft_ms: Summary
    ttft_gap_ms: Summary

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _values(xs: Sequence[float | None]) -> list[float]:
    return [x for x in xs if x is not None]


def compute_metrics(records: Sequence[RequestRecord], slo: Slo | None = None) -> Metrics:
    """Metrics of a run's records (any order). Raises ValueError for no records."""
    if not records:
        raise ValueError("no records")
    ok = [r for r in records if r.ok]
    end = max((r.done_s for r in records if r.done_s is not None), default=0.0)
    start = min(r.scheduled_s for r in records)
    duration = max(end - start, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    short_limit = statistics.median_low(r.max_tokens for r in records)
    good = good_tokens = attainment = None
    if slo is not None and slo.is_set:
        met = [r for r in records if slo.met_by(r)]
        good = len(met) / duration
        good_tokens = sum(r.output_tokens for r in met) / duration
        attainment = len(met) / len(records)
    return Metrics(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        input_tokens=sum(r.input_tokens for r in ok),
        output_tokens=out_tokens,
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        requests_per_s=len(ok) / duration,
        output_tokens_per_s=out_tokens / duration,
        goodput_requests_per_s=good,
        goodput_output_tokens_per_s=good_tokens,
        slo_attainment=attainment,
        ttft_ms=Summary.of(_values([r.ttft_ms for r in ok])),
        tpot_ms=Summary.of(_values([r.tpot_ms for r in ok])),
        itl_ms=Summary.of([x for r in ok for x in r.itl_ms]),
        e2e_ms=Summary.of(_values([r.e2e_ms for r in ok])),
        short_e2e_ms=Summary.of(_values([r.e2e_ms for r in ok if r.max_tokens <= short_limit])),
        engine_queue_ms=Summary.of(_values([r.engine_queue_ms for r in ok])),
        engine_ttft_ms=Summary.of(_values([r.engine_ttft_ms for r in ok])),
        ttft_gap_ms=Summary.of(_values([r.ttft_gap_ms for r in ok])),
    )
