"""The JSON document's schema, the text tables and the PNG figures, on hand-made records."""

from __future__ import annotations

import json

import pytest

from service.bench.metrics import Slo
from service.bench.plots import safe_name, write_plots
from service.bench.record import RequestRecord
from service.bench.report import (FIGURES, SCHEMA, comparison, document, format_comparison,
                                  format_run, run_failure, write_json)
from service.bench.run_result import RunResult

SUMMARY_KEYS = {"count", "mean", "median", "p90", "p99", "max"}
RECORD_KEYS = {"index", "request_id", "input_tokens", "max_tokens", "scheduled_s", "connection",
               "sent_s", "done_s", "delta_times_s", "delta_token_counts", "finish_reason",
               "prompt_tokens", "completion_tokens", "cached_tokens", "engine_queue_ms",
               "engine_ttft_ms", "engine_tpot_ms", "engine_e2e_ms", "preemptions", "error",
               "ok", "output_tokens", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_gap_ms"}


def _run(label: str, kind: str, step: float) -> RunResult:
    records = []
    for i in range(3):
        sent = 0.05 * i
        times = [sent + step * (k + 1) for k in range(4)]
        records.append(RequestRecord(index=i, request_id=f"b{i}", input_tokens=8, max_tokens=4,
                                     scheduled_s=sent, connection=0, sent_s=sent,
                                     done_s=times[-1] + 0.01, delta_times_s=times,
                                     delta_token_counts=[1] * 4, finish_reason="length",
                                     prompt_tokens=8, completion_tokens=4, cached_tokens=0,
                                     engine_queue_ms=1.0, engine_ttft_ms=step * 1000 - 1))
    records.append(RequestRecord(index=3, request_id="b3", input_tokens=8, max_tokens=4,
                                 scheduled_s=0.2, sent_s=0.2, error="connection closed"))
    run = RunResult(label, kind, records, {"url": "ws://127.0.0.1:1/v1/stream"})
    run.compute(Slo(ttft_ms=150.0))
    return run


def test_document_schema():
    runs = [_run("max_num_seqs=4", "conveyor", 0.1), _run("max_num_seqs=8", "conveyor", 0.2)]
    doc = json.loads(json.dumps(document({"workload": "uniform", "request_rate": None},
                                         ["--compare", "max_num_seqs=4,8"], runs),
                                allow_nan=False))
    assert doc["schema"] == SCHEMA
    assert set(doc) == {"schema", "created", "argv", "config", "runs", "comparison"}
    assert doc["argv"] == ["--compare", "max_num_seqs=4,8"]
    for run in doc["runs"]:
        assert set(run) == {"label", "kind", "target", "metrics", "failure", "requests"}
        assert run["failure"] is None
        m = run["metrics"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "engine_queue_ms", "engine_ttft_ms",
                    "ttft_gap_ms"):
            assert set(m[key]) == SUMMARY_KEYS
        assert (m["completed"], m["failed"], m["num_requests"]) == (3, 1, 4)
        assert isinstance(m["output_tokens_per_s"], float) and m["output_tokens"] == 12
        assert len(run["requests"]) == 4
        for rec in run["requests"]:
            assert set(rec) == RECORD_KEYS
        assert [r["ok"] for r in run["requests"]] == [True, True, True, False]
    table = doc["comparison"]
    assert table["baseline"] == "max_num_seqs=4" and table["failures"] == [None, None]
    assert [row["figure"] for row in table["rows"]] == [name for name, _ in FIGURES]
    ttft = next(row for row in table["rows"] if row["figure"] == "TTFT mean ms")
    assert ttft["values"] == pytest.approx([100.0, 200.0])
    assert ttft["ratios"] == pytest.approx([1.0, 2.0])
    goodput = next(row for row in table["rows"] if row["figure"] == "goodput req/s")
    assert goodput["values"][1] == 0.0 and goodput["ratios"][1] == 0.0


def test_write_json_round_trips(tmp_path):
    path = tmp_path / "bench.json"
    write_json(str(path), document({}, [], [_run("conveyor", "conveyor", 0.1)]))
    doc = json.loads(path.read_text())
    assert doc["comparison"] is None and doc["runs"][0]["label"] == "conveyor"


def test_text_tables():
    a, b = _run("conveyor", "conveyor", 0.1), _run("hf-static", "hf-static", 0.3)
    text = format_run(a, Slo(ttft_ms=150.0))
    for needle in ("== conveyor (conveyor) ==", "3 completed, 1 failed", "TTFT", "TPOT", "ITL",
                   "E2E", "goodput", "ttft <= 150 ms", "FAILED b3: connection closed",
                   "TTFT gap client-engine"):
        assert needle in text, needle
    table = comparison([a, b])
    assert table is not None and comparison([a]) is None
    text = format_comparison(table)
    assert "ratios to conveyor" in text and "(x3.00)" in text and "hf-static" in text


def test_a_failed_run_is_marked_failed_not_left_empty_or_zero():
    ok = _run("conveyor", "conveyor", 0.1)
    dead = _run("llama-server", "llama-server", 0.1)
    dead.failure = "llama-server died mid-run: killed by signal SIGILL (exit code -4)"
    nothing = RunResult("hf-static", "hf-static", [
        RequestRecord(index=0, request_id="b0", input_tokens=8, max_tokens=4, scheduled_s=0.0,
                      error="HTTP 500: boom")])
    nothing.compute(None)
    assert run_failure(ok) is None and run_failure(dead) == dead.failure
    assert run_failure(nothing) == "no request completed (first error: HTTP 500: boom)"
    assert "  FAILED: no request completed" in format_run(nothing)
    table = comparison([ok, dead, nothing])
    assert table["failures"] == [None, dead.failure, run_failure(nothing)]
    rows = {row["figure"]: row["values"] for row in table["rows"]}
    assert rows["output tok/s"][2] is None and rows["ITL median ms"][2] is None
    assert rows["failed"] == [1.0, 1.0, 1.0]
    assert rows["ITL median ms"][0] == pytest.approx(100.0)
    text = format_comparison(table)
    header = text.splitlines()[1]
    assert "llama-server FAILED" in header and "hf-static FAILED" in header
    assert "conveyor FAILED" not in header
    assert "FAILED" in text.splitlines()[2].split()[-1]  # hf-static's output tok/s cell
    assert f"llama-server FAILED: {dead.failure}" in text


def test_run_result_rejects_bad_input():
    with pytest.raises(ValueError, match="kind"):
        RunResult("x", "vllm", _run("a", "conveyor", 0.1).records)
    with pytest.raises(ValueError, match="no records"):
        RunResult("x", "conveyor", [])


def test_plots_are_png_files(tmp_path):
    runs = [_run("max_num_seqs=4", "conveyor", 0.1), _run("hf-continuous", "hf-continuous", 0.2)]
    paths = write_plots(runs, str(tmp_path / "figs"))
    names = sorted(p.name for p in paths)
    assert names == ["latency_cdf.png", "throughput.png", "timeline-hf-continuous.png",
                     "timeline-max_num_seqs-4.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert safe_name("batching=static") == "batching-static" and safe_name("///") == "run"
