"""`conveyor bench` / `scripts/bench`: load generator, latency report, comparisons, peers.

    scripts/bench --workload medium --request-rate 4 --json out.json --plot figs/
    scripts/bench --url ws://127.0.0.1:8765/v1/stream --workload shared-prefix
    scripts/bench --compare enable_prefix_caching=true,false --workload shared-prefix
    scripts/bench --max-num-seqs 8 --peer hf-static --peer hf-continuous --scale 0.25
    scripts/bench --workload one-user --peer llama-server   # one request at a time
    scripts/bench --engine-only --quantization none,int8     # no socket: ms per step
    scripts/bench --agentic --sessions 4 --turns 4           # multi-turn sessions, disk KV tier
    scripts/bench --real-sizes --model F.gguf --peer llama-server  # beside llama-server, as is

`--engine-only` (first argument or anywhere) hands the remaining arguments to the
engine-only benchmark (`service.bench.engine_only`, its own `--help`); `--agentic` the
same way to the multi-turn agentic workload with and without the disk KV tier
(`service.bench.agentic`); `--real-sizes` to the side-by-side table of GGUF files on
Conveyor and llama-server (`service.bench.real_sizes`).

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
from dataclasses import replace
from pathlib import Path

from service.bench.arrivals import arrival_times
from service.bench.batching_bound import batching_bound
from service.bench.cli_parser import build_parser as _build_parser
from service.bench.compare import CompareSpec
from service.bench.engine_args import check_serve_args, engine_parser, serve_args
from service.bench.llama_peer import LlamaPeerOptions, run_llama_peer
from service.bench.load_sweep import (DEFAULT_LOAD_SLO, SweepPoint, arrival_rates, bound_share,
                                      capacity, format_sweep, load_label, parse_fractions,
                                      sweep_json)
from service.bench.metrics import Slo
from service.bench.peers import PEER_NOTES, PEERS, load_hf_model, run_peer
from service.bench.plan import LoadPlan, auto_connections
from service.bench.report import (comparison, document, format_comparison, format_run,
                                  run_failure, write_json)
from service.bench.run_result import RunResult
from service.bench.runner import run_server
from service.bench.server_process import ServerProcess, exit_text, signal_name
from service.bench.tokenizer import load_tokenizer
from service.bench.workloads import build_workload, default_max_concurrency
from service.worker.cpu_threads import default_num_threads

LLAMA_FLAGS = ("llama_server_bin", "llama_server_url", "llama_server_model", "llama_server_args")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `conveyor bench` (service.bench.cli_parser)."""
    return _build_parser(__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--engine-only" in argv:
        from service.bench.engine_only import main as engine_only_main

        return engine_only_main([x for x in argv if x != "--engine-only"])
    if "--agentic" in argv:
        from service.bench.agentic import main as agentic_main

        return agentic_main([x for x in argv if x != "--agentic"])
    if "--real-sizes" in argv:
        from service.bench.real_sizes import main as real_sizes_main

        return real_sizes_main([x for x in argv if x != "--real-sizes"])
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
    if a.load:
        _check_load(a)
    if a.slo:
        Slo.parse(a.slo)
    if "llama-server" in a.peer:
        if not a.llama_server_url:
            _llama_options(a).resolve_binary()
    elif any(getattr(a, f) for f in LLAMA_FLAGS):
        raise ValueError("the --llama-server-* options need --peer llama-server")
    if a.json:
        folder = Path(a.json).resolve().parent
        try:  # created before the run, so that a bad path fails in seconds, not after it
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--json {a.json}: cannot create its folder: {e}") from None
    compare = CompareSpec.parse(a.compare) if a.compare else None
    if a.load and (compare.name != "batching" or "continuous" not in compare.values):
        raise ValueError("--load compares batching modes: --compare batching=... must "
                         "include continuous (its capacity sets the arrival rates)")
    if not a.url and not a.no_server:
        for _, args in _servers(a, compare):
            check_serve_args(args)
    return compare


def _check_load(a: argparse.Namespace) -> None:
    """--load's own rules; fills in its defaults (--compare and --slo)."""
    parse_fractions(a.load)
    if a.url or a.no_server:
        raise ValueError("--load starts its own servers; drop --url / --no-server")
    if not math.isinf(a.request_rate):
        raise ValueError("--load sets the arrival rates itself; drop --request-rate")
    a.compare = a.compare or "batching=continuous,static,dynamic"
    a.slo = a.slo or DEFAULT_LOAD_SLO


def _llama_options(a: argparse.Namespace) -> LlamaPeerOptions:
    model = a.llama_server_model or (a.model if a.model and a.model.endswith(".gguf") else None)
    return LlamaPeerOptions(binary=a.llama_server_bin, url=a.llama_server_url, model=model,
                            extra_args=a.llama_server_args,
                            threads=a.num_threads or default_num_threads(),
                            start_timeout_s=a.server_start_timeout)


def _served(a: argparse.Namespace) -> argparse.Namespace:
    """The engine options the started servers get (--server-args may override flags)."""
    return engine_parser().parse_known_args(serve_args(a) + shlex.split(a.server_args))[0]


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
    concurrency = a.max_concurrency  # unset: the workload's own, e.g. one-user's 1
    if concurrency is None:
        concurrency = default_max_concurrency(a.workload)
    connections = a.connections or auto_connections(len(specs), concurrency)
    plan = LoadPlan(tuple(specs), tuple(arrivals), max_concurrency=concurrency,
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
    if any(p in PEERS for p in peers):
        runs += _peer_runs(a, plan, [p for p in peers if p in PEERS], tokenizer, slo)
    if "llama-server" in peers:
        _say("running the llama-server peer ...")
        runs.append(_finish(run_llama_peer(plan, _llama_options(a),
                                           max_num_seqs=_served(a).max_num_seqs,
                                           progress=not a.no_progress), slo))
    table = comparison(runs)
    if table is not None:
        print(format_comparison(table), flush=True)
    for run in runs:
        if run_failure(run):
            _say(f"{run.label} FAILED: {run_failure(run)}")
    if bound is not None:
        print(f"flat-step bound (an ideal machine where a step costs the same at any batch "
              f"size, prefill free): continuous batching needs {bound['continuous_steps']} "
              f"steps and static {bound['static_steps']} for these output lengths and this "
              f"concurrency, so there continuous / static output tokens/s would be "
              f"{bound['ratio']:.2f}x. Measured ratios can exceed it: a static batch starts "
              f"with whatever has arrived, and its prefill does not overlap decodes.",
              flush=True)
        share = _bound_share(runs, compare, bound)
        config["batching_bound"]["closed_loop_share"] = share
        if share is not None:
            print(f"closed loop: measured continuous / static output tok/s is "
                  f"{100 * share:.0f}% of the flat-step bound's ratio", flush=True)
    sweep: tuple[list[RunResult], list[SweepPoint], dict] | None = None
    if a.load:
        sweep = _load_sweep(a, plan, compare, slo, runs, bound)
        print(format_sweep(sweep[2]["capacity_requests_per_s"], slo, sweep[1],
                           sweep[2]["closed_loop_bound_share"]), flush=True)
    all_runs = runs + (sweep[0] if sweep else [])
    if a.json:
        doc = document(config, argv, all_runs)
        doc["comparison"] = table  # the closed-loop runs and the peers
        doc["load_sweep"] = sweep[2] if sweep else None
        write_json(a.json, doc)
        _say(f"wrote {a.json}")
    if a.plot:
        from service.bench.plots import plot_load_sweep, write_plots

        for path in write_plots(all_runs, a.plot):
            _say(f"wrote {path}")
        if sweep:
            _say(f"wrote {plot_load_sweep(sweep[1], slo, Path(a.plot) / 'load_sweep.png')}")
    runs = all_runs
    failed = sum(r.metrics.failed for r in runs if r.metrics is not None)
    if failed:
        _say(f"{failed} request(s) failed")
    return 1 if failed else 0


def _server_runs(a: argparse.Namespace, plan: LoadPlan, compare: CompareSpec | None,
                 slo: Slo | None) -> list[RunResult]:
    if a.url:
        records = _run_async(run_server(a.url, plan, progress=not a.no_progress))
        return [_finish(RunResult("conveyor", "conveyor", records, {"url": a.url}), slo)]
    return [_server_run(a, label, args, plan, slo) for label, args in _servers(a, compare)]


def _server_run(a: argparse.Namespace, label: str, args: list[str], plan: LoadPlan,
                slo: Slo | None) -> RunResult:
    """One fresh `conveyor serve` with `args`, the plan run against it, then stopped; a
    server that exited during the run makes it FAILED, its exit code and signal named."""
    _say(f"starting conveyor serve {shlex.join(args)} ...")
    with ServerProcess(args, start_timeout_s=a.server_start_timeout) as server:
        records = _run_async(run_server(server.url, plan, progress=not a.no_progress,
                                        desc=label))
        rc = server.exited(wait_s=0.0 if all(r.ok for r in records) else 2.0)
        target = {"serve_args": args, "url": server.url, "server_log": server.log_path}
    failure = None
    if rc is not None:
        target.update(exit_code=rc, signal=signal_name(rc))
        failure = (f"conveyor serve died mid-run: {exit_text(rc)}, after "
                   f"{sum(r.ok for r in records)} of {len(records)} requests completed "
                   f"(log: {server.log_path})")
    return _finish(RunResult(label, "conveyor", records, target, failure=failure), slo)


def _load_sweep(a: argparse.Namespace, plan: LoadPlan, compare: CompareSpec, slo: Slo,
                closed: list[RunResult], bound: dict | None
                ) -> tuple[list[RunResult], list[SweepPoint], dict]:
    """--load (service.bench.load_sweep): each mode under Poisson arrivals at each fraction
    of continuous batching's closed-loop capacity. Returns (runs, points, JSON object)."""
    by_label = {r.label: r for r in closed}
    cont = by_label[compare.label("continuous")]
    cap = capacity(cont.metrics)
    fractions = parse_fractions(a.load)
    runs, points = [], []
    for f, rate in zip(fractions, arrival_rates(cap, fractions)):
        arrivals = arrival_times(len(plan.requests), rate, a.burstiness, a.seed)
        loaded = replace(plan, arrivals=tuple(arrivals))
        _say(f"load {f:g}: Poisson arrivals at {rate:.3f} req/s ({f:g} x {cap:.3f})")
        for label, args in _servers(a, compare):
            run = _server_run(a, load_label(label, f), args, loaded, slo)
            runs.append(run)
            points.append(SweepPoint(label, f, rate, run.metrics))
    return runs, points, sweep_json(cap, slo, points, _bound_share(closed, compare, bound))


def _bound_share(runs: list[RunResult], compare: CompareSpec, bound: dict | None) -> float | None:
    """Measured continuous / static output tok/s over the flat-step bound's ratio."""
    by_label = {r.label: r.metrics for r in runs}
    cont, static = (by_label.get(compare.label(m)) for m in ("continuous", "static"))
    return bound_share(cont.output_tokens_per_s if cont else None,
                       static.output_tokens_per_s if static else None,
                       bound["ratio"] if bound else None)


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
    served = _served(a)
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
        "load": list(parse_fractions(a.load)) if a.load else None,
        "llama_server": {f: getattr(a, f) for f in LLAMA_FLAGS} if "llama-server" in a.peer
        else None,
    }


if __name__ == "__main__":
    sys.exit(main())
