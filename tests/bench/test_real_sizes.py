"""`scripts/bench --real-sizes`: its figures, table and ratios, VmHWM parsing, the CPU
summary, argument checks, the phases' context, and one (file, server) measured end to end
against the fake llama-server (tests/bench/fake_llama_server.py). The real binary and model:
test_real_sizes_e2e below, marked slow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from service.bench.llama_server import LlamaServerProcess
from service.bench.machine import cpu_summary, flags_text
from service.bench.plan import LoadPlan
from service.bench.real_sizes import _run_llama, measure
from service.bench.real_sizes_args import build_parser, check_args, phases_of
from service.bench.real_sizes_figures import Figures, Row, format_table, parse_vmhwm, ratios
from service.bench.real_sizes_plan import Phases, RealSizesConfig, build_phases
from service.bench.request_spec import RequestSpec

FAKE = Path(__file__).with_name("fake_llama_server.py")
STATUS = """Name:\tllama-server
State:\tS (sleeping)
VmPeak:\t 2345678 kB
VmHWM:\t  123456 kB
VmRSS:\t  100000 kB
Threads:\t3
"""


def test_vmhwm_is_read_in_bytes_from_the_status_text() -> None:
    assert parse_vmhwm(STATUS) == 123456 * 1024
    with pytest.raises(ValueError, match="no VmHWM"):
        parse_vmhwm("Name:\tkthreadd\nState:\tS (sleeping)\n")
    with pytest.raises(ValueError, match="malformed"):
        parse_vmhwm("VmHWM:\t12 MB\n")


def test_ratios_are_conveyor_over_llama_and_none_where_missing() -> None:
    conv = Figures(load_s=3.0, itl_p50_ms=10.0, one_user_tok_s=50.0, concurrent_tok_s=None,
                   long_ttft_ms=400.0, vmhwm_mib=600.0)
    llama = Figures(load_s=1.5, itl_p50_ms=5.0, one_user_tok_s=100.0, concurrent_tok_s=300.0,
                    long_ttft_ms=0.0, vmhwm_mib=200.0)
    assert ratios(conv, llama) == {"load_s": 2.0, "itl_p50_ms": 2.0, "one_user_tok_s": 0.5,
                                   "concurrent_tok_s": None, "long_ttft_ms": None,
                                   "vmhwm_mib": 3.0}


def test_the_table_has_a_row_per_file_and_server_and_a_ratio_row_per_file() -> None:
    full = Figures(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    rows = [Row("a.gguf", "conveyor", Figures(2.0, 4.0, 3.0, 8.0, 10.0, 3.0)),
            Row("a.gguf", "llama-server", full),
            Row("b.gguf", "conveyor", full),
            Row("b.gguf", "llama-server", Figures(load_s=0.5), failure="died: exit code 3")]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:2] == ["file", "server"] and "VmHWM MiB" in lines[0]
    assert "8-conc tok/s" in lines[0] and "TTFT 2000t ms" in lines[0]
    assert lines[1].split() == ["a.gguf", "conveyor", "2.00", "4.00", "3.0", "8.0", "10.0", "3.0"]
    assert lines[2].split() == ["a.gguf", "llama-server", "1.00", "2.00", "3.0", "4.0", "5.0",
                                "6.0"]
    assert lines[3].split() == ["a.gguf", "conveyor/llama", "x2.00", "x2.00", "x1.00", "x2.00",
                                "x2.00", "x0.50"]
    assert lines[5].split() == ["b.gguf", "llama-server", "FAILED", "0.50", "FAILED", "FAILED",
                                "FAILED", "FAILED", "FAILED"]
    assert lines[6].split() == ["b.gguf", "conveyor/llama", "x2.00", "-", "-", "-", "-", "-"]
    assert lines[7] == "b.gguf llama-server FAILED: died: exit code 3"
    assert len(lines) == 8


def test_a_file_without_its_peer_has_no_ratio_row() -> None:
    lines = format_table([Row("a.gguf", "conveyor", Figures(1.0))], concurrent=4,
                         long_prompt=600).splitlines()
    assert len(lines) == 2 and "4-conc tok/s" in lines[0] and "TTFT 600t ms" in lines[0]


def test_cpu_summary_names_the_model_and_the_extension_groups() -> None:
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx avx2 fma "
            "avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    s = cpu_summary(text)
    assert s["model_name"] == "AMD EPYC 9R14" and s["logical_cpus"] == 2
    assert s["flags"] == {"avx2": True, "avx512": True, "avx512_vnni": True, "avx_vnni": False,
                          "avx512_bf16": True, "amx": False}
    assert flags_text(s) == "avx2 avx512 avx512_vnni avx512_bf16"
    assert flags_text(cpu_summary("")) == "none"


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--model", "x.safetensors"], "give a .gguf file"),
    (["--model", "missing.gguf"], "no such file"),
    (["--llama-server-args", "-fa on"], "need --peer llama-server"),
    (["--peer", "llama-server", "--llama-server-bin", "/no/such/bin"], "no such file"),
    (["--num-threads", "0"], "--num-threads 0"),
    (["--one-user-requests", "0"], "one_user_requests must be >= 1"),
    (["--long-prompt", "0"], "long_prompt must be >= 1"),
    (["--timeout", "0"], "timeout_s must be > 0"),
    (["--phases", "one_user,warmup"], "give some of one_user, concurrent, long, or none"),
    (["--phases", ""], "give some of"),
    (["--repeat", "0"], "--repeat 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_args(_args(*argv))


def test_a_file_given_twice_is_refused(tmp_path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="given twice"):
        check_args(_args("--model", str(f), "--model", str(tmp_path / "." / "m.gguf")))
    assert check_args(_args("--model", str(f))) == RealSizesConfig()


def test_bench_cli_hands_real_sizes_over(capsys) -> None:
    from service.bench.cli import main

    assert main(["--real-sizes", "--model", "nope.txt"]) == 2
    assert "give a .gguf file" in capsys.readouterr().err


def test_phases_share_one_context_and_the_long_prompt_is_cold(bench_tokenizer) -> None:
    phases = build_phases(bench_tokenizer, RealSizesConfig())
    assert [s.input_len for s in phases.one_user.requests] == [100, 100, 100]
    assert [s.max_tokens for s in phases.one_user.requests] == [64, 64, 64]
    assert phases.one_user.max_concurrency == 1 and phases.one_user.warmup == 1
    conc = phases.concurrent
    assert len(conc.requests) == 8 and conc.max_concurrency == 8 and conc.warmup == 0
    assert all(100 <= s.input_len <= 500 and 50 <= s.max_tokens <= 200 for s in conc.requests)
    (long,) = phases.long.requests
    assert (long.input_len, long.max_tokens) == (2000, 1)
    assert all(p.ignore_eos and p.temperature == 0 for p in (phases.one_user, conc, phases.long))
    # 2,000 + 1 (+ 8 margin) rounded up to 256; 8 sequences
    assert (phases.slot_ctx, phases.n_seqs, phases.ctx_total) == (2048, 8, 16384)
    assert phases.conveyor_args() == ["--max-num-seqs", "8", "--max-model-len", "2048",
                                      "--block-size", "16", "--num-kv-blocks", "1024"]
    # no earlier prompt starts like the long one: a prefix cache has nothing to hit
    earlier = [s.prompt_token_ids for s in (*phases.one_user.requests, *conc.requests)]
    assert all(p[:8] != long.prompt_token_ids[:8] for p in earlier)
    assert build_phases(bench_tokenizer, RealSizesConfig()) == phases  # seeded


def _tiny_phases() -> Phases:
    def plan(specs, concurrency, warmup=0):
        return LoadPlan(tuple(specs), (0.0,) * len(specs), max_concurrency=concurrency,
                        warmup=warmup)

    return Phases(
        one_user=plan([RequestSpec(i, (100 + i, 5, 6), 6) for i in range(3)], 1, warmup=1),
        concurrent=plan([RequestSpec(i, (200 + i, 5), 5) for i in range(4)], 4),
        long=plan([RequestSpec(0, tuple(range(300, 340)), 1)], 1))


def _fake_binary(tmp_path: Path, env: str = "") -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\n{env}exec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def _server(binary: Path, phases: Phases) -> LlamaServerProcess:
    return LlamaServerProcess(binary, "/m/f.gguf", n_parallel=phases.n_seqs,
                              slot_ctx=phases.slot_ctx, threads=1, start_timeout_s=30)


def test_one_server_measured_end_to_end_on_the_fake(tmp_path) -> None:
    phases = _tiny_phases()
    server = _server(_fake_binary(tmp_path), phases)
    row, detail = measure("f.gguf", "llama-server", server, phases, _run_llama(True))
    assert row.failure is None, row.failure
    f = row.figures
    assert all(v is not None and v > 0 for v in f.to_json().values()), f
    assert server.proc.poll() is not None  # stopped
    assert set(detail["phases"]) == {"one_user", "concurrent", "long"}
    assert all(len(detail["loadavg"][k]) == 3 for k in ("start", "end"))
    assert detail["target"]["argv"][detail["target"]["argv"].index("-np") + 1] == "4"
    json.dumps(detail, allow_nan=False)


def test_phases_none_measures_the_load_and_the_memory_alone(tmp_path) -> None:
    assert phases_of(_args("--phases", "none")) == ()
    assert phases_of(_args("--phases", "long, one_user")) == ("one_user", "long")
    assert phases_of(_args()) == ("one_user", "concurrent", "long")
    phases = _tiny_phases()
    server = _server(_fake_binary(tmp_path), phases)
    row, detail = measure("f.gguf", "llama-server", server, phases, _run_llama(True), ())
    assert row.failure is None and detail["phases"] == {}
    assert row.figures.load_s > 0 and row.figures.vmhwm_mib is not None
    assert row.figures.itl_p50_ms is None and row.figures.long_ttft_ms is None


def test_a_server_that_dies_mid_run_is_a_failed_row_with_what_was_measured(tmp_path) -> None:
    # the warm-up and the three one-user requests are served, then SIGILL
    phases = _tiny_phases()
    server = _server(_fake_binary(tmp_path, "FAKE_LLAMA_DIE_AFTER=4 "), phases)
    row, _ = measure("f.gguf", "llama-server", server, phases, _run_llama(True))
    assert row.failure.startswith("llama-server died: killed by signal SIGILL (exit code -4) "
                                  "(concurrent: 4 of 4 requests failed")
    assert row.figures.load_s > 0 and row.figures.itl_p50_ms is not None
    assert row.figures.concurrent_tok_s is None and row.figures.vmhwm_mib is None


def test_a_server_that_cannot_start_is_a_failed_row(tmp_path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    binary.chmod(0o755)
    phases = _tiny_phases()
    row, detail = measure("f.gguf", "llama-server", _server(binary, phases), phases,
                          _run_llama(True))
    assert row.failure.startswith("llama-server exited with code 3 while starting (log: ")
    assert row.figures == Figures() and detail["target"]["exit_code"] == 3


@pytest.mark.slow
def test_real_sizes_e2e_on_the_default_gguf(tmp_path) -> None:
    """The whole mode on the default 135M GGUF (small phases), with the real llama-server
    when built (this checkout's build/llama.cpp/bin, or $CONVEYOR_LLAMA_SERVER)."""
    from service.bench.llama_server import find_llama_server
    from service.bench.real_sizes import main

    out = tmp_path / "rs.json"
    argv = ["--no-progress", "--one-user-requests", "2", "--one-user-output", "16",
            "--concurrent", "4", "--long-prompt", "600", "--json", str(out)]
    if find_llama_server() is not None:
        argv += ["--peer", "llama-server"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["files"][0]["file_type"] == "MOSTLY_Q4_1"
    for row in doc["rows"]:
        assert row["failure"] is None
        assert all(v is not None for v in row["figures"].values())
