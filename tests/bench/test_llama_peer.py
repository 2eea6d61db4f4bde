"""The llama-server peer's client and process handling, against a fake server that speaks
llama-server's HTTP and streaming format (tests/bench/fake_llama_server.py). The real
binary is exercised in tests/integration/test_llama_server_peer.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from service.bench.llama_client import ChunkCounter, request_body, run_llama_server
from service.bench.llama_peer import LlamaPeerOptions, n_parallel
from service.bench.llama_server import LlamaServerProcess, q4_model, slot_context
from service.bench.metrics import compute_metrics
from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.request_spec import RequestSpec
from tests.bench.fake_llama_server import FakeLlamaServer

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def fake():
    server = FakeLlamaServer(token_delay_s=0.002).start_background()
    yield server
    server.shutdown()
    server.server_close()


def _plan(first_ids: list[int], max_tokens: int = 5, **kw) -> LoadPlan:
    specs = tuple(RequestSpec(i, (f, 50, 60, 70), max_tokens) for i, f in enumerate(first_ids))
    return LoadPlan(specs, tuple(0.01 * i for i in range(len(specs))), **kw)


def test_records_every_token_with_its_time_and_sends_the_same_token_ids(fake) -> None:
    plan = _plan([100, 101, 102], max_tokens=6, warmup=1, temperature=0.0)
    records = asyncio.run(run_llama_server(fake.base_url, plan, progress=False))
    assert [r.error for r in records] == [None, None, None]
    for rec, spec in zip(records, plan.requests):
        assert rec.ok and rec.output_tokens == 6 and rec.delta_token_counts == [1] * 6
        assert rec.delta_times_s == sorted(rec.delta_times_s)
        assert rec.sent_s <= rec.delta_times_s[0] <= rec.done_s
        assert rec.ttft_ms > 0 and len(rec.itl_ms) == 5 and rec.tpot_ms > 0
        assert (rec.prompt_tokens, rec.completion_tokens, rec.finish_reason) == (4, 6, "length")
        assert rec.engine_tpot_ms == 2.5
    bodies = [b for b in fake.bodies if b.get("stream")]
    assert len(bodies) == 3 and len(fake.bodies) == 4  # one warm-up request first
    by_first = {b["prompt"][0]: b for b in bodies}
    for spec in plan.requests:
        b = by_first[spec.prompt_token_ids[0]]
        assert b["prompt"] == list(spec.prompt_token_ids)
        assert (b["max_tokens"], b["temperature"], b["ignore_eos"]) == (6, 0.0, True)
        assert "seed" not in b
    m = compute_metrics(records)
    assert m.completed == 3 and m.output_tokens == 18


def test_sampled_requests_carry_a_seed_each() -> None:
    plan = _plan([100, 101], temperature=0.8, seed=40)
    assert [request_body(s, plan)["seed"] for s in plan.requests] == [40, 41]


def test_max_concurrency_bounds_requests_in_flight(fake) -> None:
    plan = _plan([100] * 6, max_tokens=4, max_concurrency=2, warmup=0)
    records = asyncio.run(run_llama_server(fake.base_url, plan, progress=False))
    assert all(r.ok for r in records)
    events = sorted([(r.sent_s, 1) for r in records] + [(r.done_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, d in events:
        in_flight += d
        peak = max(peak, in_flight)
    assert peak <= 2


@pytest.mark.parametrize("fault, expected", [
    (1, "HTTP 500"), (2, "fake mid-stream error"), (3, "closed connection"),
    (5, "4 tokens received under ignore_eos"),
])
def test_faults_fail_only_their_own_request(fake, fault, expected) -> None:
    plan = _plan([fault, 100], max_tokens=5, warmup=0)
    bad, good = asyncio.run(run_llama_server(fake.base_url, plan, progress=False))
    assert bad.error is not None and expected in bad.error and not bad.ok
    assert good.ok and good.output_tokens == 5


def test_a_token_without_a_chunk_is_booked_at_the_final_event(fake) -> None:
    plan = _plan([4], max_tokens=5, warmup=0)
    (rec,) = asyncio.run(run_llama_server(fake.base_url, plan, progress=False))
    assert rec.ok, rec.error
    assert rec.delta_token_counts == [1, 1, 1, 1, 1][:4] + [1]  # 4 chunks + 1 booked at the end
    assert rec.output_tokens == 5 and rec.completion_tokens == 5


def test_chunk_counter_unit() -> None:
    spec = RequestSpec(0, (1, 2), 3)
    rec = RequestRecord(0, "b0", 2, 3, 0.0, sent_s=0.0)
    c = ChunkCounter(spec, rec, ignore_eos=False)
    c.event({"choices": [{"text": "a", "finish_reason": None}]}, 0.1)
    c.event({"choices": [{"text": "", "finish_reason": None}]}, 0.2)  # held-back stop text
    c.event({"choices": [{"text": "", "finish_reason": "stop"}],
             "usage": {"completion_tokens": 3, "prompt_tokens": 2}}, 0.4)
    assert rec.delta_times_s == [0.1, 0.2, 0.4] and rec.delta_token_counts == [1, 1, 1]
    assert rec.done_s == 0.4 and c.problems() == []
    with pytest.raises(ValueError, match="server error: boom"):
        c.event({"error": {"message": "boom"}}, 0.5)
    with pytest.raises(ValueError, match="unexpected event"):
        c.event({"object": "text_completion"}, 0.5)
    empty = ChunkCounter(spec, RequestRecord(1, "b1", 2, 3, 0.0), ignore_eos=True)
    assert "without a final chunk" in empty.problems()[0]


def test_slots_and_context() -> None:
    assert slot_context([500, 100], [200, 10]) == 768
    assert slot_context([10], [5]) == 256
    plan = _plan([100] * 20)
    assert n_parallel(plan, 16) == 16 and n_parallel(plan, 32) == 20
    assert n_parallel(_plan([100] * 20, max_concurrency=4), 16) == 4


def test_process_starts_waits_for_health_and_stops(tmp_path, monkeypatch) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    argv_out = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_ARGV_OUT", str(argv_out))
    server = LlamaServerProcess(binary, "/m/model.gguf", n_parallel=3, slot_ctx=512, threads=2,
                                extra_args=["--seed", "1"], start_timeout_s=30)
    with server:
        argv = json.loads(argv_out.read_text())
        records = asyncio.run(run_llama_server(server.base_url, _plan([100, 101]),
                                               progress=False))
        proc = server.proc
    assert all(r.ok for r in records)
    assert proc.poll() is not None  # stopped on exit
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["-m"] == "/m/model.gguf" and flags["-np"] == "3" and flags["-c"] == "1536"
    assert flags["-t"] == "2" and flags["-tb"] == "2" and flags["--port"] == str(server.port)
    assert argv[-2:] == ["--seed", "1"]


def test_process_that_exits_while_starting_is_reported(tmp_path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*failed to load model"):
        with LlamaServerProcess(binary, "x.gguf", n_parallel=1, slot_ctx=256, threads=1):
            pass


def test_missing_binary_names_the_build_script(monkeypatch, tmp_path) -> None:
    import service.bench.llama_server as ls

    monkeypatch.delenv("CONVEYOR_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(ls, "DEFAULT_BIN_DIR", tmp_path)
    with pytest.raises(ValueError, match="scripts/build_llama_server"):
        LlamaPeerOptions().resolve_binary()
    with pytest.raises(ValueError, match="no such file"):
        LlamaPeerOptions(binary=str(tmp_path / "nope")).resolve_binary()


def test_the_default_gguf_is_q4_and_used_as_it_is(tmp_path) -> None:
    from service.worker.loader import default_model_path

    path, kind = q4_model(default_model_path(), None, tmp_path)
    assert kind == "MOSTLY_Q4_1" and str(path) == default_model_path()
    assert list(tmp_path.iterdir()) == []


def _fake_binary(tmp_path: Path, env: str = "") -> Path:
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(f"#!/bin/sh\n{env}exec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def _tiny_q4_gguf(path: Path) -> Path:
    """A GGUF whose header says Q4_1 and one 4-float tensor: read in milliseconds (the
    real file's reader takes seconds), enough for the peer's weight-type check."""
    import gguf
    import numpy as np

    if not path.is_file():
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
        w.add_tensor("x", np.zeros(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


def _peer(binary: Path, plan: LoadPlan, tmp_path: Path):
    from service.bench.llama_peer import run_llama_peer

    model = _tiny_q4_gguf(tmp_path / "tiny.gguf")
    return run_llama_peer(plan, LlamaPeerOptions(binary=str(binary), model=str(model),
                                                 start_timeout_s=30),
                          max_num_seqs=4, progress=False, cache_dir=tmp_path / "models")


def test_a_peer_that_dies_mid_run_is_a_failed_run_naming_the_signal(tmp_path) -> None:
    from service.bench.report import comparison, format_comparison, format_run, run_failure

    # the warm-up and the first request are served, the second POST gets SIGILL
    binary = _fake_binary(tmp_path, "FAKE_LLAMA_DIE_AFTER=2 ")
    plan = _plan([100, 101, 102], max_tokens=4, max_concurrency=1, warmup=1)
    run = _peer(binary, plan, tmp_path)
    m = run.compute(None)
    assert (m.completed, m.failed) == (1, 2)
    assert run.failure.startswith("llama-server died mid-run: killed by signal SIGILL (exit "
                                  "code -4), after 1 of 3 requests completed (log: ")
    assert run.target["exit_code"] == -4 and run.target["signal"] == "SIGILL"
    assert run.records[0].ok
    for rec in run.records[1:]:
        assert rec.error.startswith("llama-server died (killed by signal SIGILL (exit code -4))")
    assert run_failure(run) == run.failure and run.to_json()["failure"] == run.failure
    assert "FAILED: llama-server died mid-run: killed by signal SIGILL" in format_run(run)
    other = _peer(_fake_binary(tmp_path / "ok"), plan, tmp_path)
    other.compute(None)
    table = comparison([other, run])
    assert table["failures"] == [None, run.failure]
    text = format_comparison(table)
    assert "llama-server FAILED" in text.splitlines()[1]
    assert "llama-server FAILED: llama-server died mid-run" in text


def test_a_peer_that_dies_at_the_warm_up_or_while_starting_measures_nothing(tmp_path) -> None:
    from service.bench.report import comparison

    plan = _plan([100, 101], max_tokens=4, warmup=1)
    run = _peer(_fake_binary(tmp_path, "FAKE_LLAMA_DIE_AFTER=0 "), plan, tmp_path)
    m = run.compute(None)
    assert (m.completed, m.failed) == (0, 2)
    assert "killed by signal SIGILL (exit code -4), after 0 of 2" in run.failure
    assert all("warm-up" in r.error and "SIGILL" in r.error for r in run.records)
    table = comparison([run, run])
    tok_s = next(row for row in table["rows"] if row["figure"] == "output tok/s")
    failed = next(row for row in table["rows"] if row["figure"] == "failed")
    assert tok_s["values"] == [None, None] and failed["values"] == [2.0, 2.0]  # not a silent 0
    crash = tmp_path / "crash" / "llama-server"
    crash.parent.mkdir()
    crash.write_text("#!/bin/sh\necho 'illegal instruction' >&2\nkill -ILL $$\n")
    crash.chmod(0o755)
    run = _peer(crash, plan, tmp_path)
    run.compute(None)
    assert run.failure.startswith("llama-server exited with code -4 (killed by SIGILL) while "
                                  "starting (log: ")
    assert run.target["signal"] == "SIGILL" and run.metrics.failed == 2


def test_one_user_runs_one_request_at_a_time_and_a_dead_peer_fails_the_bench(
        tmp_path, capsys, monkeypatch, bench_tokenizer) -> None:
    import service.bench.cli as cli
    from service.bench.cli import main

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: bench_tokenizer)  # loaded once

    model = _tiny_q4_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "one-user.json"
    argv = ["--workload", "one-user", "--num-requests", "3", "--scale", "0.05", "--no-server",
            "--peer", "llama-server", "--llama-server-model", str(model), "--no-progress"]
    assert main([*argv, "--llama-server-bin", str(_fake_binary(tmp_path / "ok")),
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["workload"] == "one-user" and doc["config"]["max_concurrency"] == 1
    (run,) = doc["runs"]
    assert run["target"]["n_parallel"] == 1 and run["failure"] is None
    assert run["metrics"]["completed"] == 3
    spans = sorted((r["sent_s"], r["done_s"]) for r in run["requests"])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # never two at once
    capsys.readouterr()
    dead = _fake_binary(tmp_path / "dead", "FAKE_LLAMA_DIE_AFTER=2 ")
    assert main([*argv, "--llama-server-bin", str(dead), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "llama-server FAILED: llama-server died mid-run: killed by signal SIGILL" in err
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["failure"].startswith("llama-server died mid-run")
    assert doc["runs"][0]["target"]["signal"] == "SIGILL"
