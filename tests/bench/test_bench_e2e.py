"""A short real benchmark through `service.bench.cli.main`: it starts its own server
subprocess with the real model, runs the transformers peers in-process, and writes the
JSON report and the figures. Only correctness is asserted, never timings."""

from __future__ import annotations

import json
import os

import pytest

from service.bench.cli import main


@pytest.mark.model
@pytest.mark.slow
def test_bench_against_its_own_server_and_the_peers(tmp_path, capsys):
    out, figs = tmp_path / "bench.json", tmp_path / "figs"
    rc = main(["--workload", "uniform", "--num-requests", "4", "--scale", "0.125",
               "--connections", "2", "--slo", "ttft=600000",
               "--max-num-seqs", "4", "--num-kv-blocks", "64",
               "--peer", "hf-static", "--peer", "hf-continuous",
               "--json", str(out), "--plot", str(figs), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "comparison (ratios to conveyor)" in captured.out

    doc = json.loads(out.read_text())
    assert doc["schema"] == "conveyor-bench/1"
    assert doc["config"]["num_requests"] == 4 and doc["config"]["connections"] == 2
    assert [r["label"] for r in doc["runs"]] == ["conveyor", "hf-static", "hf-continuous"]
    server, *peers = doc["runs"]
    args = server["target"]["serve_args"]
    assert len(args) == 4 and {tuple(args[i:i + 2]) for i in (0, 2)} == {
        ("--num-kv-blocks", "64"), ("--max-num-seqs", "4")}
    assert os.path.isfile(server["target"]["server_log"])
    for run in doc["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (4, 0), run["label"]
        assert m["output_tokens"] == 64 and m["input_tokens"] == 64
        assert m["ttft_ms"]["count"] == 4 and m["tpot_ms"]["count"] == 4
        assert m["itl_ms"]["count"] >= 4
        assert m["goodput_requests_per_s"] is not None
        for rec in run["requests"]:
            assert rec["ok"] and rec["error"] is None, rec
            assert rec["output_tokens"] == rec["completion_tokens"] == rec["max_tokens"] == 16
            assert rec["prompt_tokens"] == rec["input_tokens"] == 16
            assert rec["finish_reason"] == "length"
            times = rec["delta_times_s"]
            assert times == sorted(times) and rec["sent_s"] <= times[0] <= rec["done_s"]
            assert rec["ttft_ms"] > 0 and rec["e2e_ms"] >= rec["ttft_ms"]
    # the server's own timings came back, so the client-server TTFT gap is measured
    assert all(r["engine_ttft_ms"] is not None and r["ttft_gap_ms"] is not None
               for r in server["requests"])
    assert {r["connection"] for r in server["requests"]} == {0, 1}
    # the peers have no separate server clock
    assert all(r["engine_ttft_ms"] is None for p in peers for r in p["requests"])
    assert doc["comparison"]["rows"][0]["ratios"][0] == 1.0
    assert sorted(p.name for p in figs.iterdir()) == [
        "latency_cdf.png", "throughput.png", "timeline-conveyor.png",
        "timeline-hf-continuous.png", "timeline-hf-static.png"]
