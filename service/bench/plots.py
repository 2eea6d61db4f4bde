"""PNG figures of a benchmark (matplotlib, Agg backend: no display needed).

    latency_cdf.png        CDFs of TTFT, TPOT, ITL and E2E, one line per run
    throughput.png         output tokens per second over the run, one line per run
    load_sweep.png         --load: goodput, SLO attainment and TTFT p99 against the load
                           fraction, one line per batching mode
    timeline-<label>.png   one row per request, the classic batching diagram:

        request 3  .[queued  ][prefill][decode ..............]|
                   ^sent     ^sent + engine queue_ms       first token    last token, | done

The queued phase uses the engine's own queue_ms (Conveyor's done.timings, or the peer's
wait before its batch/step), laid from the client-observed send time; prefill runs to the
first token, decode to the last token; a tick marks the done.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from service.bench.run_result import RunResult

if TYPE_CHECKING:
    from service.bench.load_sweep import SweepPoint
    from service.bench.metrics import Slo

PHASE_COLORS = {"queued": "#b0b0b0", "prefill": "#f28e2b", "decode": "#4e79a7"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_latency_cdfs(runs: Sequence[RunResult], path: Path) -> None:
    """2x2 CDFs (TTFT, TPOT, ITL, E2E in ms) of completed requests, a line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("TTFT", lambda r: [r.ttft_ms]), ("TPOT", lambda r: [r.tpot_ms]),
              ("ITL", lambda r: r.itl_ms), ("E2E", lambda r: [r.e2e_ms]))
    for ax, (name, get) in zip(axes.flat, panels):
        for run in runs:
            values = [v for rec in run.records if rec.ok for v in get(rec) if v is not None]
            if values:
                ax.step(*_cdf(values), where="post", label=run.label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} CDF")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(runs: Sequence[RunResult], path: Path, points: int = 200,
                    windows: int = 40) -> None:
    """Output tokens/s over time: at each of `points` instants, the tokens that arrived
    within a centred window of 1/`windows` of the longest run, divided by its width."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    per_run = [(run, sorted(t for rec in run.records if rec.ok
                            for t, n in zip(rec.delta_times_s, rec.delta_token_counts)
                            for _ in range(n)))
               for run in runs]
    end = max((ts[-1] for _, ts in per_run if ts), default=0.0)
    width = max(end / windows, 1e-3)
    xs = [end * i / (points - 1) for i in range(points)]
    for run, times in per_run:
        if not times:
            continue
        lo = bisect.bisect_left
        ys = [(lo(times, x + width / 2) - lo(times, x - width / 2)) / width for x in xs]
        ax.plot(xs, ys, label=run.label)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel(f"output tokens/s ({width:.2g} s window)")
    ax.set_title("output throughput over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(run: RunResult, path: Path) -> None:
    """One row per request (by index): queued, prefill, decode bars and a done tick."""
    plt = _pyplot()
    records = sorted(run.records, key=lambda r: r.index)
    fig, ax = plt.subplots(figsize=(12, min(40.0, max(3.0, 0.22 * len(records) + 1.5))))
    for row, rec in enumerate(records):
        if rec.sent_s is None:
            continue
        queued_end = rec.sent_s + (rec.engine_queue_ms or 0.0) / 1000.0
        first, last = rec.first_token_s, rec.last_token_s
        spans = [("queued", rec.sent_s, queued_end)]
        if first is not None and last is not None:
            spans += [("prefill", queued_end, first), ("decode", first, last)]
        for phase, a, b in spans:
            if b > a:
                ax.broken_barh([(a, b - a)], (row - 0.4, 0.8), color=PHASE_COLORS[phase])
        ax.plot([rec.sent_s], [row], marker=".", color="black", markersize=3)
        if rec.done_s is not None:
            ax.plot([rec.done_s], [row], marker="|", color="red" if not rec.ok else "black",
                    markersize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    ax.legend(handles, list(PHASE_COLORS), loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8)
    if len(records) <= 120:
        ax.set_yticks(range(len(records)))
        ax.set_yticklabels([r.request_id for r in records], fontsize=6 if len(records) > 40 else 8)
    ax.set_ylabel("request")
    ax.invert_yaxis()
    ax.set_xlabel("time since the run started (s)")
    ax.set_title(f"request timeline: {run.label} ({run.kind}); dot = sent, | = done")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def safe_name(label: str) -> str:
    """A file-name-safe form of a run label: 'max_num_seqs=4' -> 'max_num_seqs-4'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"


def write_plots(runs: Sequence[RunResult], folder: str) -> list[Path]:
    """Write every figure into `folder` (created if missing); returns the paths written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency_cdf.png", out / "throughput.png"]
    plot_latency_cdfs(runs, paths[0])
    plot_throughput(runs, paths[1])
    for run in runs:
        path = out / f"timeline-{safe_name(run.label)}.png"
        plot_timeline(run, path)
        paths.append(path)
    return paths


def plot_load_sweep(points: Sequence[SweepPoint], slo: Slo, path: Path) -> Path:
    """Three panels against the load fraction, a line per mode: goodput (req/s), SLO
    attainment (%) and TTFT p99 (ms, with the SLO's TTFT bound dashed). Returns `path`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("goodput req/s", "goodput (req/s meeting the SLO)"),
              ("SLO met %", "SLO attainment (%)"), ("TTFT p99 ms", "TTFT p99 (ms)"))
    for ax, (key, title) in zip(axes, panels):
        for mode in dict.fromkeys(p.mode for p in points):
            mine = sorted((p for p in points if p.mode == mode), key=lambda p: p.fraction)
            xs = [p.fraction for p in mine if p.figures()[key] is not None]
            ys = [p.figures()[key] for p in mine if p.figures()[key] is not None]
            ax.plot(xs, ys, marker="o", label=mode)
        if key == "TTFT p99 ms" and slo.ttft_ms is not None:
            ax.axhline(slo.ttft_ms, linestyle="--", color="gray", linewidth=1)
        ax.set_xlabel("load (fraction of continuous batching's capacity)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
