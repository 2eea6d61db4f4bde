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
