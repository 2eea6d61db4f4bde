"""Load plans, --compare specs, engine flags forwarded to `conveyor serve`, CLI argument errors."""

from __future__ import annotations

import pytest

from service.bench.cli import build_parser, main
from service.bench.compare import CompareSpec
from service.bench.engine_args import serve_args
from service.bench.plan import LoadPlan, auto_connections
from service.bench.request_spec import RequestSpec
from service.engine_args import build_parser as serve_parser

SPEC = RequestSpec(7, (1, 2, 3), 4)


def test_load_plan():
    plan = LoadPlan((SPEC,), (0.0,), temperature=0.7, seed=100)
    assert plan.params(SPEC) == {"max_tokens": 4, "temperature": 0.7, "ignore_eos": True,
                                 "seed": 107}
    assert "seed" not in LoadPlan((SPEC,), (0.0,)).params(SPEC)
    for bad in ({"arrivals": (0.0, 1.0)}, {"max_concurrency": 0}, {"connections": 0},
                {"temperature": -1.0}, {"timeout_s": 0.0}, {"warmup": -1}):
        with pytest.raises(ValueError):
            LoadPlan(**{"requests": (SPEC,), "arrivals": (0.0,), **bad})
    with pytest.raises(ValueError, match="non-decreasing"):
        LoadPlan((SPEC, RequestSpec(8, (1,), 1)), (1.0, 0.5))


def test_auto_connections():
    assert auto_connections(10, None) == 1
    assert auto_connections(64, None) == 1
    assert auto_connections(200, None) == 4
    assert auto_connections(200, 16) == 1
    assert auto_connections(200, 65) == 2


def test_compare_spec_flags_are_accepted_by_conveyor_serve():
    caching = CompareSpec.parse("enable_prefix_caching=true,false")
    assert caching.values == ("true", "false")
    assert caching.serve_args("true") == ["--enable-prefix-caching"]
    assert caching.serve_args("false") == ["--no-enable-prefix-caching"]
    seqs = CompareSpec.parse("max-num-seqs=4,8")
    assert seqs.name == "max_num_seqs" and seqs.serve_args("8") == ["--max-num-seqs", "8"]
    assert seqs.label("4") == "max_num_seqs=4"
    parse = serve_parser().parse_args
    assert parse(["serve", *caching.serve_args("false")]).enable_prefix_caching is False
    assert parse(["serve", *caching.serve_args("true")]).enable_prefix_caching is True
    assert parse(["serve", "--max-num-seqs", "2", *seqs.serve_args("8")]).max_num_seqs == 8
    assert CompareSpec.parse("batching=static,dynamic,continuous").serve_args("static") == [
        "--batching", "static"]


@pytest.mark.parametrize("text", ["max_num_seqs", "=4,8", "max_num_seqs=4,,8",
                                  "max_num_seqs=4,4", "bad name=1"])
def test_compare_spec_errors(text):
    with pytest.raises(ValueError):
        CompareSpec.parse(text)


def test_engine_options_round_trip_to_conveyor_serve():
    ns = build_parser().parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching",
                                    "--kv-cache-memory", "512MiB", "--workload", "medium"])
    args = serve_args(ns)
    assert ["--kv-cache-memory", str(512 << 20)] == args[args.index("--kv-cache-memory"):][:2]
    assert "--no-enable-prefix-caching" in args and "--workload" not in args
    served = serve_parser().parse_args(["serve", *args])
    assert served.max_num_seqs == 8
    assert served.enable_prefix_caching is False
    assert served.kv_cache_memory == 512 << 20
    assert serve_args(build_parser().parse_args([])) == []


@pytest.mark.parametrize("argv", [
    ["--url", "ws://127.0.0.1:1/v1/stream", "--compare", "max_num_seqs=4,8"],
    ["--no-server"],
    ["--no-server", "--peer", "hf-static", "--url", "ws://127.0.0.1:1/v1/stream"],
    ["--slo", "ttft=-1"],
    ["--compare", "max_num_seqs"],
    ["--compare", "no_such_engine_option=1,2"],
    ["--compare", "max_num_seqs=4,many"],
    ["--request-rate", "0"],
    ["--scale", "-1"],
    ["--max-concurrency", "0"],
    ["--json", "/dev/null/out.json"],  # its folder cannot be created under a file
])
def test_cli_rejects_bad_combinations_before_any_work(argv, capsys):
    assert main(argv) == 2
    assert "conveyor bench:" in capsys.readouterr().err


def test_json_folder_is_created_before_any_work(tmp_path):
    from service.bench.cli import _check_args

    out = tmp_path / "new" / "deeper" / "run.json"
    _check_args(build_parser().parse_args(["--json", str(out), "--url",
                                           "ws://127.0.0.1:1/v1/stream"]))
    assert out.parent.is_dir() and not out.exists()


def test_batching_bound_only_for_batching_compare_with_all_at_once_arrivals():
    from service.bench.cli import _batching_bound

    specs = tuple(RequestSpec(i, (1,), n) for i, n in enumerate([4, 1, 1, 1]))
    plan = LoadPlan(specs, (0.0,) * 4, max_concurrency=2)
    ns = build_parser().parse_args(["--max-num-seqs", "2"])
    batching = CompareSpec.parse("batching=continuous,static")
    # the hand-worked case of tests/bench/test_batching_bound.py
    assert _batching_bound(ns, plan, batching) == {"continuous_steps": 4, "static_steps": 5,
                                                   "ratio": 1.25}
    assert _batching_bound(ns, plan, None) is None
    assert _batching_bound(ns, plan, CompareSpec.parse("max_num_seqs=2,4")) is None
    poisson = build_parser().parse_args(["--max-num-seqs", "2", "--request-rate", "3"])
    assert _batching_bound(poisson, plan, batching) is None
    eos = LoadPlan(specs, (0.0,) * 4, max_concurrency=2, ignore_eos=False)  # lengths unknown
    assert _batching_bound(ns, eos, batching) is None
    # --server-args wins over --max-num-seqs, as it does for the servers: 4 slots, then
    # continuous [4,1] -> [3,1] -> [2,1] -> [1] (4 steps); static [4,1] 4, [1,1] 1 (5 steps)
    wider = build_parser().parse_args(["--max-num-seqs", "1", "--server-args",
                                       "--max-num-seqs 2"])
    assert _batching_bound(wider, plan, batching)["static_steps"] == 5


def test_a_conveyor_server_that_dies_mid_run_makes_its_run_failed(monkeypatch, capsys):
    import service.bench.cli as cli
    from service.bench.record import RequestRecord

    class DeadServer:  # stands in for ServerProcess: killed by SIGKILL during the run
        url, log_path = "ws://127.0.0.1:1/v1/stream", "/tmp/server.log"

        def __init__(self, args, start_timeout_s):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def exited(self, wait_s=0.0):
            return -9

    async def run_server(url, plan, progress, desc):
        return [RequestRecord(0, "b0", 3, 4, 0.0, sent_s=0.0, error="connection closed")]

    monkeypatch.setattr(cli, "ServerProcess", DeadServer)
    monkeypatch.setattr(cli, "run_server", run_server)
    plan = LoadPlan((SPEC,), (0.0,))
    run = cli._server_run(build_parser().parse_args([]), "conveyor", [], plan, None)
    assert run.failure == ("conveyor serve died mid-run: killed by signal SIGKILL (exit code "
                           "-9), after 0 of 1 requests completed (log: /tmp/server.log)")
    assert run.target["signal"] == "SIGKILL" and run.target["exit_code"] == -9
    assert "FAILED: conveyor serve died mid-run" in capsys.readouterr().out
