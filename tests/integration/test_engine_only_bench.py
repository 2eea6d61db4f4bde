"""The engine-only benchmark runs its scenarios on the real model and reports every
section; bad arguments are refused. Figures are not checked (no timing in tests)."""

from __future__ import annotations

import json

import pytest

from service.bench.engine_only import SECTIONS, main, run


def test_small_run_reports_every_variant_scenario_and_section(loaded_model) -> None:
    report = run(["--quantization", "none,int8", "--cpu-decode-kernel", "cpp,sdpa",
                  "--decode-seqs", "1,3", "--context", "40",
                  "--steps", "2", "--rounds", "2", "--warmup", "1", "--prefill-len", "24",
                  "--prefill-steps", "1", "--threads", "1"], loaded=loaded_model)
    results = report["results"]
    assert list(results) == ["decode-1", "decode-3", "prefill-24"]
    for scenario, by_variant in results.items():
        assert list(by_variant) == ["fp32/cpp/1t", "fp32/sdpa/1t", "int8/cpp/1t", "int8/sdpa/1t"]
        for r in by_variant.values():
            assert r["tokens_per_s"] > 0 and r["steps_per_s"] > 0
            assert len(r["ms_per_step_run_medians"]) == 2  # one per round
            assert r["steps_measured"] == (4 if scenario.startswith("decode") else 2)
            sections = r["sections_ms_mean"]
            assert list(sections) == list(SECTIONS)
            assert all(v >= 0 for v in sections.values())
            # a fused step (one native call: int8 decode steps where the C++ kernels serve
            # every layer) is all "fused"; prefill steps are never fused
            fused = sections["fused"] > 0
            assert fused or (sections["linear"] > 0 and sections["attention"] > 0)
            assert not fused or scenario.startswith("decode")
            # the sections are disjoint parts of the step
            assert sum(sections.values()) <= r["ms_per_step_mean"] * 1.0001
    r3 = results["decode-3"]["fp32/cpp/1t"]
    assert r3["tokens_per_s"] == pytest.approx(3 * r3["steps_per_s"])
    # the decode-1 bandwidth bound: both bandwidths, and the weight bytes of each variant
    bw = report["read_bandwidth"]
    assert bw["before_gb_s"] > 0 and bw["after_gb_s"] > 0 and bw["threads"] == 1
    bound = report["decode_1_bandwidth_bound"]
    assert list(bound) == list(results["decode-1"])
    fp32 = bound["fp32/cpp/1t"]
    # fp32 reads every linear weight as stored: [N, K] float32 of the 30 layers' projections
    # and the LM head (tied to the embedding in this checkpoint)
    w = loaded_model.weights
    projections = [t for name, t in w.items() if name.endswith("_proj.weight")]
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    dense = sum(t.numel() * 4 for t in [*projections, head])
    assert fp32["weight_bytes_per_step"] == dense
    assert bound["int8/cpp/1t"]["weight_bytes_per_step"] < dense / 3  # 1 byte a weight + scales
    for b in bound.values():
        assert b["read_gb_s"] == max(bw["before_gb_s"], bw["after_gb_s"])
        assert b["bound_ms"] == pytest.approx(b["weight_bytes_per_step"] / (b["read_gb_s"] * 1e6))
        assert b["fraction_of_bound"] == pytest.approx(b["bound_ms"] / b["ms_per_step"])
        assert b["median_read_gb_s"] == max(bw["before_median_gb_s"], bw["after_median_gb_s"])
        assert b["median_read_gb_s"] <= b["read_gb_s"]
        assert b["fraction_of_bound_at_median"] == pytest.approx(
            b["bound_ms_at_median"] / b["ms_per_step"])
        assert b["bound_ms_at_median"] >= b["bound_ms"]
    assert report["machine"]["cores"] >= 1 and len(report["machine"]["load_average_before"]) == 3


def test_cpu_hog_and_the_adaptive_thread_variant(loaded_model) -> None:
    report = run(["--decode-seqs", "1,2", "--context", "24", "--steps", "3", "--rounds", "2",
                  "--warmup", "0", "--prefill-len", "0", "--threads", "1,auto",
                  "--cpu-hog", "1"], loaded=loaded_model)
    assert report["machine"]["cpu_hogs"] == 1
    # the default variant is what `conveyor serve` runs: --quantization auto
    assert list(report["results"]["decode-2"]) == ["auto/cpp/1t", "auto/cpp/auto"]
    assert report["results"]["decode-2"]["auto/cpp/auto"]["steps_measured"] == 6
    assert list(report["thread_tuning"]) == ["decode-1", "decode-2"]  # a tuner per scenario
    assert list(report["thread_tuning"]["decode-2"]) == ["auto/cpp/auto"]


@pytest.mark.parametrize("argv", [["--quantization", "fp8"], ["--threads", "0"],
                                  ["--threads", "auto,x"], ["--cpu-hog", "-1"],
                                  ["--decode-seqs", "", "--prefill-len", "0"],
                                  ["--steps", "0"], ["--decode-seqs", "a"],
                                  ["--cpu-decode-kernel", "fast"],
                                  ["--cpu-decode-kernel", "auto,cpp"],
                                  ["--cpu-fused-decode", "fast"], ["--cpu-fused-decode", "off,off"],
                                  ["--cpu-decode-kernel", "cpp,cpp"]])
def test_bad_arguments_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    assert "engine-only bench" in capsys.readouterr().err


def test_json_written(loaded_model, tmp_path, monkeypatch, capsys) -> None:
    import service.bench.engine_only as eo

    monkeypatch.setattr(eo, "load_model", lambda *a, **k: loaded_model)
    out = tmp_path / "r.json"
    assert main(["--decode-seqs", "1", "--context", "16", "--steps", "1", "--rounds", "1",
                 "--warmup", "0", "--prefill-len", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["decode-1"]
    assert f"wrote {out}" in capsys.readouterr().out


def test_scripts_bench_engine_only_dispatches_to_it(capsys) -> None:
    from service.bench.cli import main as bench_main

    # refused by the engine-only parser (no model load), not by the load generator's
    assert bench_main(["--engine-only", "--steps", "0"]) == 2
    assert "engine-only bench" in capsys.readouterr().err
