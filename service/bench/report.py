"""Text tables of a benchmark, the comparison table of several runs, and the JSON document.

JSON document (`SCHEMA` = "conveyor-bench/1"):

    {"schema": "conveyor-bench/1", "created": ISO-8601 UTC, "argv": [...],
     "config": {workload, seed, scale, num_requests, request_rate, burstiness,
                max_concurrency, connections, temperature, ignore_eos, slo, ...},
     "runs": [{"label", "kind", "target": {...},
               "metrics": {num_requests, completed, failed, duration_s, ...,
                           ttft_ms: {count, mean, median, p90, p99, max}, ...},
               "failure": null or what went wrong with the target (e.g. it died),
               "requests": [RequestRecord.to_json(), ...]}],
     "comparison": {"baseline": label, "labels": [...], "failures": [null | text, ...],
                    "rows": [{"figure", "values": [...], "ratios": [...]}]} or null}

Ratios are value / baseline value (the first run), None where either is missing or the
baseline is 0. A run FAILED (`run_failure`) when its target failed or no request of it
completed: its column says so in the text table, and its figures are None in the
comparison (not 0) when nothing was measured.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence

from service.bench.metrics import Metrics, Slo
from service.bench.run_result import RunResult
from service.bench.stats import Summary

SCHEMA = "conveyor-bench/1"

FIGURES: tuple[tuple[str, Callable[[Metrics], float | None]], ...] = (
    ("output tok/s", lambda m: m.output_tokens_per_s),
    ("requests/s", lambda m: m.requests_per_s),
    ("goodput req/s", lambda m: m.goodput_requests_per_s),
    ("goodput tok/s", lambda m: m.goodput_output_tokens_per_s),
    ("TTFT mean ms", lambda m: m.ttft_ms.mean),
    ("TTFT median ms", lambda m: m.ttft_ms.median),
    ("TTFT p99 ms", lambda m: m.ttft_ms.p99),
    ("TPOT mean ms", lambda m: m.tpot_ms.mean),
    ("TPOT p99 ms", lambda m: m.tpot_ms.p99),
    ("ITL mean ms", lambda m: m.itl_ms.mean),
    ("ITL median ms", lambda m: m.itl_ms.median),
    ("ITL p99 ms", lambda m: m.itl_ms.p99),
    ("E2E mean ms", lambda m: m.e2e_ms.mean),
    ("E2E p99 ms", lambda m: m.e2e_ms.p99),
    ("short E2E mean ms", lambda m: m.short_e2e_ms.mean),
    ("failed", lambda m: float(m.failed)),
)


def run_failure(run: RunResult) -> str | None:
    """Why `run` (computed) FAILED, or None: its target failed, or no request completed."""
    if run.failure:
        return run.failure
    m = run.metrics
    if m is not None and m.completed == 0:
        first = next((r.error for r in run.records if r.error), None)
        return "no request completed" + (f" (first error: {first})" if first else "")
    return None


def _num(x: float | None, width: int = 10) -> str:
    if x is None:
        return "-".rjust(width)
    return (f"{x:.1f}" if abs(x) < 1e6 else f"{x:.3g}").rjust(width)


def _summary_row(name: str, s: Summary) -> str:
    cells = (s.mean, s.median, s.p90, s.p99, s.max)
    return f"  {name:<24}" + "".join(_num(c) for c in cells) + f"{s.count:>8}"


def format_run(run: RunResult, slo: Slo | None = None) -> str:
    """A few lines: counts, throughput, goodput, latency table of one computed run."""
    m = run.metrics
    assert m is not None, "RunResult.compute() first"
    lines = [f"== {run.label} ({run.kind}) ==",
             f"  requests: {m.completed} completed, {m.failed} failed, in {m.duration_s:.2f} s; "
             f"{m.input_tokens} input tokens ({m.cached_tokens} from the prefix cache), "
             f"{m.output_tokens} output tokens",
             f"  throughput: {m.output_tokens_per_s:.1f} output tok/s, {m.requests_per_s:.3f} req/s"]
    if m.goodput_requests_per_s is not None and slo is not None:
        bounds = ", ".join(f"{k} <= {v:g} ms" for k, v in
                           (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2e", slo.e2e_ms))
                           if v is not None)
        lines.append(f"  goodput: {m.goodput_requests_per_s:.3f} req/s, "
                     f"{m.goodput_output_tokens_per_s:.1f} output tok/s ({bounds}); "
                     f"{100 * (m.slo_attainment or 0):.1f}% of requests met the SLO")
    lines.append(f"  {'latency (ms)':<24}" + "".join(h.rjust(10) for h in
                                                     ("mean", "median", "p90", "p99", "max"))
                 + "samples".rjust(8))
    for name, s in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms),
                    ("E2E", m.e2e_ms), ("E2E short requests", m.short_e2e_ms),
                    ("engine queue", m.engine_queue_ms),
                    ("engine TTFT", m.engine_ttft_ms), ("TTFT gap client-engine", m.ttft_gap_ms)):
        if s.count:
            lines.append(_summary_row(name, s))
    failure = run_failure(run)
    if failure:
        lines.insert(1, f"  FAILED: {failure}")
    errors = [r for r in run.records if not r.ok]
    for r in errors[:5]:
        lines.append(f"  FAILED {r.request_id}: {r.error or 'no done'}")
    if len(errors) > 5:
        lines.append(f"  ... and {len(errors) - 5} more failures (see the JSON)")
    return "\n".join(lines)


def comparison(runs: Sequence[RunResult]) -> dict[str, object] | None:
    """Each FIGURES value of every run and its ratio to the first run; None for < 2 runs."""
    if len(runs) < 2:
        return None
    metrics = [r.metrics for r in runs]
    assert all(m is not None for m in metrics), "RunResult.compute() first"
    rows = []
    for name, get in FIGURES:
        # a run that completed nothing measured nothing: None, not a throughput of 0
        values = [float(m.failed) if name == "failed" else None if m.completed == 0 else get(m)
                  for m in metrics]  # type: ignore[union-attr]
        base = values[0]
        ratios = [None if v is None or not base else v / base for v in values]
        rows.append({"figure": name, "values": values, "ratios": ratios})
    return {"baseline": runs[0].label, "labels": [r.label for r in runs],
            "failures": [run_failure(r) for r in runs], "rows": rows}


def format_comparison(table: dict[str, object]) -> str:
    """The comparison as text: one row per figure, 'value (x ratio)' per run."""
    labels: list[str] = table["labels"]  # type: ignore[assignment]
    failures = table.get("failures") or [None] * len(labels)
    heads = [label + (" FAILED" if failed else "") for label, failed in zip(labels, failures)]
    width = max(18, *(len(head) + 2 for head in heads))
    lines = [f"== comparison (ratios to {table['baseline']}) ==",
             f"  {'figure':<16}" + "".join(head.rjust(width) for head in heads)]
    for row in table["rows"]:  # type: ignore[attr-defined]
        cells = []
        for v, ratio, failed in zip(row["values"], row["ratios"], failures):
            text = ("FAILED" if failed else "-") if v is None else f"{v:.1f}"
            if ratio is not None:
                text += f" (x{ratio:.2f})"
            cells.append(text.rjust(width))
        lines.append(f"  {row['figure']:<16}" + "".join(cells))
    for label, failed in zip(labels, failures):
        if failed:
            lines.append(f"  {label} FAILED: {failed}")
    return "\n".join(lines)


def document(config: dict[str, object], argv: Sequence[str], runs: Sequence[RunResult]) -> dict:
    """The JSON document of a benchmark (module docstring)."""
    return {"schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(argv), "config": config,
            "runs": [r.to_json() for r in runs],
            "comparison": comparison(runs)}


def write_json(path: str, doc: dict) -> None:
    """Write `doc` to `path` (UTF-8, indented). Raises OSError."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
