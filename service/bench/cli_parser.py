"""The argument parser of `conveyor bench` (`service.bench.cli`)."""

from __future__ import annotations

import argparse
import math

from service.bench.peers import PEERS
from service.bench.workloads import WORKLOADS
from service.engine_args import add_engine_args

ALL_PEERS = (*PEERS, "llama-server")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser of `conveyor bench` (engine flags included, as `conveyor serve` has them)."""
    p = argparse.ArgumentParser(prog="conveyor bench", description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("targets")
    t.add_argument("--engine-only", action="store_true",
                   help="run the engine-only benchmark instead (no socket; ms per step split "
                        "into sections); see `scripts/bench --engine-only --help`")
    t.add_argument("--agentic", action="store_true",
                   help="run the multi-turn agentic workload instead (in process, with and "
                        "without the disk KV tier, and after a restart); see "
                        "`scripts/bench --agentic --help`")
    t.add_argument("--real-sizes", action="store_true",
                   help="Conveyor beside llama-server on the same GGUF files as they are "
                        "(load time, ITL, tok/s, long-prompt TTFT, VmHWM); see "
                        "`scripts/bench --real-sizes --help`")
    t.add_argument("--url", help="benchmark a running server (ws://HOST:PORT/v1/stream) instead "
                                 "of starting one with the engine options below")
    t.add_argument("--compare", metavar="NAME=V1,V2,...",
                   help="one fresh server per value of an engine option, e.g. "
                        "max_num_seqs=4,8 or enable_prefix_caching=true,false")
    t.add_argument("--peer", action="append", default=[], choices=ALL_PEERS,
                   help="also run a peer (repeatable): in-process transformers (hf-static, "
                        "hf-continuous) or llama.cpp's llama-server")
    t.add_argument("--no-server", action="store_true", help="run only the peers")
    t.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="extra `conveyor serve` arguments as one shell-quoted string, "
                        "e.g. --server-args='--log-level info'")
    t.add_argument("--server-start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds allowed for a started server to load and become healthy")
    ll = p.add_argument_group("llama-server peer")
    ll.add_argument("--llama-server-bin", default=None, metavar="PATH",
                    help="llama-server binary, started fresh per run with -np = the run's "
                         "concurrency (default: build/llama.cpp/bin/llama-server from "
                         "scripts/build_llama_server, or $CONVEYOR_LLAMA_SERVER)")
    ll.add_argument("--llama-server-url", default=None, metavar="URL",
                    help="a running llama-server (http://HOST:PORT) instead of starting one")
    ll.add_argument("--llama-server-model", default=None, metavar="PATH.gguf",
                    help="GGUF for llama-server (default: --model if a .gguf, else the "
                         "SmolLM2 Q4_1 file); converted to Q4_1 with llama-quantize if not 4-bit")
    ll.add_argument("--llama-server-args", default="", metavar="'ARGS'",
                    help="extra llama-server flags as one shell-quoted string")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="uniform", metavar="NAME|PATH.jsonl",
                   help=f"one of {', '.join(WORKLOADS)}, or a JSONL file of "
                        '{"messages"|"prompt", "max_tokens"}')
    w.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests (None: 32; 10 for seed-exercise, 6 for one-user; every "
                        "line of a file)")
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
    a.add_argument("--load", default=None, metavar="F1,F2,...",
                   help="fractions of continuous batching's closed-loop capacity, e.g. "
                        "0.5,0.7,0.9: after the closed-loop runs of --compare batching=... "
                        "(default continuous,static,dynamic) each mode runs again under "
                        "Poisson arrivals at each fraction; goodput at --slo (default "
                        "ttft=2000,tpot=200)")
    a.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="most requests in flight (None: no limit; 1 for --workload one-user)")
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
