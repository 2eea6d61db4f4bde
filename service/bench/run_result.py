"""One target's run: its label, what it was, its per-request records and its figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.bench.metrics import Metrics, Slo, compute_metrics
from service.bench.record import RequestRecord

KINDS = ("conveyor", "hf-static", "hf-continuous", "llama-server")


@dataclass
class RunResult:
    """kind: one of KINDS. label: its name in tables and plots (e.g. "max_num_seqs=8").
    target: how it ran (url, serve_args, server_log, notes). failure: None, or what went
    wrong with the target itself, e.g. "llama-server died mid-run: killed by signal SIGILL
    (exit code -4)"; the tables then mark the run FAILED. Raises ValueError for an
    unknown kind or no records."""

    label: str
    kind: str
    records: list[RequestRecord]
    target: dict[str, object] = field(default_factory=dict)
    metrics: Metrics | None = None
    failure: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not self.records:
            raise ValueError(f"run {self.label!r} has no records")

    def compute(self, slo: Slo | None) -> Metrics:
        self.metrics = compute_metrics(self.records, slo)
        return self.metrics

    def to_json(self) -> dict[str, object]:
        return {"label": self.label, "kind": self.kind, "target": self.target,
                "metrics": self.metrics.to_json() if self.metrics else None,
                "failure": self.failure,
                "requests": [r.to_json() for r in self.records]}
