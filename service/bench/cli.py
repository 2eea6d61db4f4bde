"""`conveyor bench` / `scripts/bench`: load generator, latency report, comparisons, peers.

    scripts/bench --workload medium --request-rate 4 --json out.json --plot figs/
    scripts/bench --url ws://127.0.0.1:8765/v1/stream --workload shared-prefix
    scripts/bench --compare enable_prefix_caching=true,false --workload shared-prefix
    scripts/bench --max-num-seqs 8 --peer hf-static --peer hf-continuous --scale 0.25
    scripts/bench --engine-only --quantization none,int8     # no socket: ms per step

`--engine-only` (first argument or anywhere) hands the remaining arguments to the
engine-only benchmark (`service.bench.engine_only`, its own `--help`).

Without --url it starts `conveyor serve` itself (a subprocess on a free port) with the
engine options given here, once per --compare value. Peers run in-process afterwards on
the same workload and send times, with the same max_num_seqs / max_num_batched_tokens.
Exit status: 0 when every request of every run completed and passed its checks, 1 when
some failed, 2 for bad arguments or inputs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from service.bench.arrivals import arrival_times
from service.bench.batching_bound import batching_bound
from service.bench.compare import CompareSpec
from service.bench.engine_args import check_serve_args, engine_parser, serve_args
from service.bench.metrics import Slo
from service.bench.peers import PEER_NOTES, PEERS, load_hf_model, run_peer
from service.bench.plan import LoadPlan, auto_connections
from service.bench.report import document, format_comparison, format_run, comparison, write_json
from service.bench.run_result import RunResult
from service.bench.runner import run_server
from service.bench.server_process import ServerProcess
from service.bench.tokenizer import load_tokenizer
from service.bench.workloads import WORKLOADS, build_workload
from service.engine_args import add_engine_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("targets")
    t.add_argument("--engine-only", action="store_true",
                   help="run the engine-only benchmark instead (no socket; ms per step split "
                        "into sections); see `scripts/bench --engine-only --help`")
    t.add_argument("--url", help="benchmark a running server (ws://HOST:PORT/v1/stream) instead "
                                 "of starting one with the engine options below")
    t.add_argument("--compare", metavar="NAME=V1,V2,...",
                   help="one fresh server per value of an engine option, e.g. "
                        "max_num_seqs=4,8 or enable_prefix_caching=true,false")
    t.add_argument("--peer", action="append", default=[], choices=PEERS,
                   help="also run an in-process transformers peer (repeatable)")
    t.add_argument("--no-server", action="store_true", help="run only the peers")
    t.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="extra `conveyor serve` arguments as one shell-quoted string, "
                        "e.g. --server-args='--log-level info'")
    t.add_argument("--server-start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds allowed for a started server to load and become healthy")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="uniform", metavar="NAME|PATH.jsonl",
                   help=f"one of {', '.join(WORKLOADS)}, or a JSONL file of "
                        '{"messages"|"prompt", "max_tokens"}')
    w.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests (None: 32; 10 for seed-exercise; every line of a file)")
    w.add_argument("--seed", type=int, default=0, help="workload, arrival and sampling seed")
    w.add_argument("--scale", type=float, default=1.0, help="multiply every length (quick runs)")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="force every completion to max_tokens")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, metavar="REQ/S",
                   help="Poisson/gamma arrivals at this mean rate; inf = all at once")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    a.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="most requests in flight (None: no limit)")
    a.add_argument("--connections", type=int, default=None, metavar="N",
                   help="WebSockets to spread requests over (None: enough for at most 64 "
                        "in flight per socket)")
    a.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="fail a request without its done after this long")
    a.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed short requests before each run")
    o = p.add_argument_group("report")
    o.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS",
                   help="goodput bounds (any of ttft, tpot, e2e, in ms)")
    o.add_argument("--json", default=None, metavar="PATH", help="write the report and "
                   "per-request records as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures into DIR")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--engine-only" in argv:
        from service.bench.engine_only import main as engine_only_main

        return engine_only_main([x for x in argv if x != "--engine-only"])
    a = build_parser().parse_args(argv)
    try:
        return _bench(a, argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"conveyor bench: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"conveyor bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _check_args(a: argparse.Namespace) -> CompareSpec | None:
    """Argument errors that need no model: raised before anything is loaded or started."""
    if a.url and a.compare:
        raise ValueError("--compare starts its own servers; it cannot be used with --url")
    if a.no_server and (a.url or a.compare):
        raise ValueError("--no-server runs only peers; drop --url / --compare")
    if a.no_server and not a.peer:
        raise ValueError("--no-server needs at least one --peer")
    for name, value, ok in (("--request-rate", a.request_rate, a.request_rate > 0),
                            ("--burstiness", a.burstiness, a.burstiness > 0),
                            ("--scale", a.scale, a.scale > 0),
                            ("--timeout", a.timeout, a.timeout > 0),
                            ("--num-requests", a.num_requests,
                             a.num_requests is None or a.num_requests >= 1),
                            ("--max-concurrency", a.max_concurrency,
                             a.max_concurrency is None or a.max_concurrency >= 1),
                            ("--connections", a.connections,
                             a.connections is None or a.connections >= 1),
                            ("--warmup", a.warmup, a.warmup >= 0)):
        if not ok:
            raise ValueError(f"{name} {value} is out of range")
    if a.slo:
        Slo.parse(a.slo)
    if a.json:
        folder = Path(a.json).resolve().parent
        try:  # created before the run, so that a bad path fails in seconds, not after it
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--json {a.json}: cannot create its folder: {e}") from None
    compare = CompareSpec.parse(a.compare) if a.compare else None
    if not a.url and not a.no_server:
        for _, args in _servers(a, compare):
            check_serve_args(args)
    return compare


def _servers(a: argparse.Namespace, compare: CompareSpec | None) -> list[tuple[str, list[str]]]:
    """(label, `conveyor serve` arguments) of each server to start, in order."""
    base = serve_args(a) + shlex.split(a.server_args)
    if compare is None:
        return [("conveyor", base)]
    return [(compare.label(v), base + compare.serve_args(v)) for v in compare.values]


def _bench(a: argparse.Namespace, argv: list[str]) -> int:
    compare = _check_args(a)
    slo = Slo.parse(a.slo) if a.slo else None
    _say(f"loading the tokenizer of {a.model or 'the default model'} ...")
    tokenizer = load_tokenizer(a.model)
    specs = build_workload(a.workload, tokenizer, num_requests=a.num_requests, seed=a.seed,
                           scale=a.scale)
    arrivals = arrival_times(len(specs), a.request_rate, a.burstiness, a.seed)
    connections = a.connections or auto_connections(len(specs), a.max_concurrency)
    plan = LoadPlan(tuple(specs), tuple(arrivals), max_concurrency=a.max_concurrency,
                    connections=connections, temperature=a.temperature, seed=a.seed,
                    ignore_eos=a.ignore_eos, timeout_s=a.timeout, warmup=a.warmup)
    config = _config(a, plan, compare)
    _say(_describe(a, plan))
    bound = _batching_bound(a, plan, compare)
    if bound is not None:
        config["batching_bound"] = bound
    runs: list[RunResult] = []
    if not a.no_server:
        runs += _server_runs(a, plan, compare, slo)
    peers = list(dict.fromkeys(a.peer))
    if peers:
        runs += _peer_runs(a, plan, peers, tokenizer, slo)
    table = comparison(runs)
    if table is not None:
        print(format_comparison(table), flush=True)
    if bound is not None:
        print(f"flat-step bound (an ideal machine where a step costs the same at any batch "
              f"size, prefill free): continuous batching needs {bound['continuous_steps']} "
              f"steps and static {bound['static_steps']} for these output lengths and this "
              f"concurrency, so there continuous / static output tokens/s would be "
              f"{bound['ratio']:.2f}x. Measured ratios can exceed it: a static batch starts "
              f"with whatever has arrived, and its prefill does not overlap decodes.",
              flush=True)
    if a.json:
        write_json(a.json, document(config, argv, runs))
        _say(f"wrote {a.json}")
    if a.plot:
        from service.bench.plots import write_plots

        for path in write_plots(runs, a.plot):
            _say(f"wrote {path}")
    failed = sum(r.metrics.failed for r in runs if r.metrics is not None)
    if failed:
        _say(f"{failed} request(s) failed")
    return 1 if failed else 0


def _server_runs(a: argparse.Namespace, plan: LoadPlan, compare: CompareSpec | None,
                 slo: Slo | None) -> list[RunResult]:
    if a.url:
        records = _run_async(run_server(a.url, plan, progress=not a.no_progress))
        return [_finish(RunResult("conveyor", "conveyor", records, {"url": a.url}), slo)]
    runs = []
    for label, args in _servers(a, compare):
        _say(f"starting conveyor serve {shlex.join(args)} ...")
        with ServerProcess(args, start_timeout_s=a.server_start_timeout) as server:
            records = _run_async(run_server(server.url, plan, progress=not a.no_progress,
                                            desc=label))
            target = {"serve_args": args, "url": server.url, "server_log": server.log_path}
        runs.append(_finish(RunResult(label, "conveyor", records, target), slo))
    return runs


def _peer_runs(a: argparse.Namespace, plan: LoadPlan, peers: list[str], tokenizer,
               slo: Slo | None) -> list[RunResult]:
    _say("loading the transformers model for the peers ...")
    model = load_hf_model(a.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runs = []
    with ThreadPoolExecutor(1, thread_name_prefix="bench-peer") as pool:
        for name in peers:
            records = pool.submit(run_peer, name, model, plan, max_num_seqs=a.max_num_seqs,
                                  max_num_batched_tokens=a.max_num_batched_tokens,
                                  pad_token_id=pad, progress=not a.no_progress).result()
            target = {"notes": PEER_NOTES[name], "max_num_seqs": a.max_num_seqs,
                      "max_num_batched_tokens": a.max_num_batched_tokens, "dtype": "float32",
                      "device": "cpu"}
            runs.append(_finish(RunResult(name, name, records, target), slo))
    return runs


def _finish(run: RunResult, slo: Slo | None) -> RunResult:
    run.compute(slo)
    print(format_run(run, slo), flush=True)
    return run


def _run_async(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _say(text: str) -> None:
    print(f"conveyor bench: {text}", file=sys.stderr, flush=True)


def _describe(a: argparse.Namespace, plan: LoadPlan) -> str:
    ins = [s.input_len for s in plan.requests]
    outs = [s.max_tokens for s in plan.requests]
    rate = "all at once" if math.isinf(a.request_rate) else \
        f"{a.request_rate:g} req/s (burstiness {a.burstiness:g})"
    return (f"workload {a.workload}: {len(ins)} requests, input {min(ins)}-{max(ins)} tokens "
            f"(mean {sum(ins) / len(ins):.0f}), output {min(outs)}-{max(outs)} "
            f"(mean {sum(outs) / len(outs):.0f}); {rate}; max concurrency "
            f"{plan.max_concurrency or 'unlimited'}; {plan.connections} connection(s)")


def _batching_bound(a: argparse.Namespace, plan: LoadPlan,
                    compare: CompareSpec | None) -> dict | None:
    """For --compare batching=... with all requests at once and output lengths forced
    (ignore_eos): batching_bound's figures, at the servers' max_num_seqs (--server-args
    may override the bench's --max-num-seqs)."""
    if (compare is None or compare.name != "batching" or not math.isinf(a.request_rate)
            or not plan.ignore_eos):
        return None
    served = engine_parser().parse_known_args(serve_args(a) + shlex.split(a.server_args))[0]
    b = batching_bound([s.max_tokens for s in plan.requests], max_num_seqs=served.max_num_seqs,
                       max_concurrency=plan.max_concurrency)
    return {"continuous_steps": b.continuous_steps, "static_steps": b.static_steps,
            "ratio": round(b.ratio, 4)}


def _config(a: argparse.Namespace, plan: LoadPlan, compare: CompareSpec | None) -> dict:
    return {
        "workload": a.workload, "seed": a.seed, "scale": a.scale,
        "num_requests": len(plan.requests),
        "request_rate": None if math.isinf(a.request_rate) else a.request_rate,
        "burstiness": a.burstiness, "max_concurrency": plan.max_concurrency,
        "connections": plan.connections, "temperature": plan.temperature,
        "ignore_eos": plan.ignore_eos, "timeout_s": plan.timeout_s, "warmup": plan.warmup,
        "slo": a.slo, "url": a.url, "serve_args": serve_args(a) + shlex.split(a.server_args),
        "compare": {"name": compare.name, "values": list(compare.values)} if compare else None,
        "peers": list(dict.fromkeys(a.peer)), "model": a.model,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
    }


if __name__ == "__main__":
    sys.exit(main())
