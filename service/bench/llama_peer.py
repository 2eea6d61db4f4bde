"""`--peer llama-server`: one run of the load plan on llama.cpp's server.

Either a running server (`--llama-server-url http://HOST:PORT`) or a binary
(`--llama-server-bin PATH`, default: what `scripts/build_llama_server` built), which is
started fresh for the run (`llama_server.LlamaServerProcess`) with:

- `-np` = the run's concurrency: max_concurrency, or every request when unset, capped
  at max_num_seqs (Conveyor's batch cap), so both batch at most as many sequences;
- the GGUF Conveyor serves (the default SmolLM2 file is Q4_1), made 4-bit with
  `llama-quantize` first when it is not (`q4_model`); the run's target names the type;
- the thread count Conveyor would take by default (affinity and CPU quota), or
  `--num-threads` when given.

A peer that fails is a result, not an exception, so that the runs already measured in
the invocation are still reported: when the server exits while starting, fails the
warm-up request, or dies mid-run (e.g. SIGILL from a build for another CPU, found by
polling the process after the run), every request it did not complete is failed with
the cause, the run's `failure` says what happened (exit code and signal named) and the
tables mark its column FAILED.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from service.bench.llama_client import run_llama_server
from service.bench.llama_server import (DEFAULT_BIN_DIR, LlamaServerProcess, find_llama_server,
                                        gguf_file_type, q4_model, slot_context)
from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.run_result import RunResult
from service.bench.runner import new_records
from service.bench.server_process import exit_text, signal_name

NOTES = ("llama.cpp llama-server, OpenAI-compatible /v1/completions streamed (SSE) with the "
         "same prompt token ids, max_tokens, ignore_eos and temperature; TTFT/ITL/E2E from "
         "the client's arrival time of each chunk")


@dataclass(frozen=True)
class LlamaPeerOptions:
    """How to reach llama-server. Exactly one of binary / url is used (url wins).

    model: the GGUF to serve (None: the default SmolLM2 file). extra_args: more
    llama-server flags. threads: -t / -tb. start_timeout_s: load + /health budget.
    """

    binary: str | None = None
    url: str | None = None
    model: str | None = None
    extra_args: str = ""
    threads: int = 1
    start_timeout_s: float = 300.0

    def resolve_binary(self) -> Path:
        """The binary to start. Raises ValueError when there is none."""
        if self.binary:
            path = Path(self.binary)
            if not path.is_file():
                raise ValueError(f"--llama-server-bin {self.binary}: no such file")
            return path
        found = find_llama_server()
        if found is None:
            raise ValueError("--peer llama-server needs --llama-server-bin PATH or "
                             "--llama-server-url URL; scripts/build_llama_server builds the "
                             f"binary from source into {DEFAULT_BIN_DIR}")
        return found


def n_parallel(plan: LoadPlan, max_num_seqs: int) -> int:
    """llama-server slots for a run: its concurrency capped at max_num_seqs.
    E.g. 32 requests, no max_concurrency, max_num_seqs 16 -> 16."""
    return max(1, min(plan.max_concurrency or len(plan.requests), max_num_seqs))


def run_llama_peer(plan: LoadPlan, opts: LlamaPeerOptions, *, max_num_seqs: int,
                   progress: bool = True, cache_dir: str | Path | None = None) -> RunResult:
    """Run `plan` on llama-server (module docstring); a RunResult of kind "llama-server"
    (not yet computed), with `failure` set when the server failed (module docstring).
    Raises ValueError / FileNotFoundError / RuntimeError when the server cannot be found
    or its model prepared (before anything was started)."""
    if opts.url:
        records, failure = _run_client(opts.url, plan, progress)
        return RunResult("llama-server", "llama-server", records,
                         {"url": opts.url, "notes": NOTES}, failure=failure)
    binary = opts.resolve_binary()
    from service.worker.loader import default_model_path

    source = opts.model or default_model_path()
    if not str(source).endswith(".gguf"):
        raise ValueError(f"llama-server needs a .gguf model, got {source}")
    quantize = binary.parent / "llama-quantize"
    model, weight_type = q4_model(source, quantize if quantize.is_file() else None,
                                  cache_dir or binary.parent.parent / "models")
    slots = n_parallel(plan, max_num_seqs)
    ctx = slot_context([s.input_len for s in plan.requests], [s.max_tokens for s in plan.requests])
    server = LlamaServerProcess(binary, model, n_parallel=slots, slot_ctx=ctx,
                                threads=opts.threads, extra_args=shlex.split(opts.extra_args),
                                start_timeout_s=opts.start_timeout_s)
    target = {"binary": str(binary), "argv": server.argv, "server_log": server.log_path,
              "model": str(model), "source_model": str(source),
              "source_weight_type": gguf_file_type(source), "weight_type": weight_type,
              "n_parallel": slots, "slot_ctx": ctx, "threads": opts.threads, "notes": NOTES,
              "llama_cpp_python_version": _built_version(binary), "build": build_info(binary)}
    try:
        server.start()
    except RuntimeError as e:  # exited or never healthy; the message carries the log's tail
        rc = server.exited()
        target.update(exit_code=rc, signal=signal_name(rc))
        server.close()
        reason = str(e).split("\n")[0].rstrip(":")
        return RunResult("llama-server", "llama-server", failed_records(plan, reason), target,
                         failure=f"{reason} (log: {server.log_path})")
    try:
        records, failure = _run_client(server.base_url, plan, progress)
        # a server that crashed is reaped a moment after its sockets closed
        rc = server.exited(wait_s=2.0 if failure or not all(r.ok for r in records) else 0.0)
    finally:
        server.close()
    if rc is not None:
        target.update(exit_code=rc, signal=signal_name(rc))
        failure = died(records, rc, server.log_path)
    return RunResult("llama-server", "llama-server", records, target, failure=failure)


def died(records: list[RequestRecord], returncode: int, log_path: str) -> str:
    """The failure text of a server that exited during the run; every request it left
    unfinished is failed with the cause (its own error kept after it)."""
    how = exit_text(returncode)
    for rec in records:
        if not rec.ok:
            rec.error = f"llama-server died ({how})" + (f": {rec.error}" if rec.error else "")
    done = sum(r.ok for r in records)
    return (f"llama-server died mid-run: {how}, after {done} of {len(records)} requests "
            f"completed (log: {log_path})")


def failed_records(plan: LoadPlan, reason: str) -> list[RequestRecord]:
    """One record per request of `plan`, each failed with `reason` (nothing was measured)."""
    records = new_records(plan)
    for rec in records:
        rec.error = reason
    return records


def _run_client(url: str, plan: LoadPlan, progress: bool) -> tuple[list[RequestRecord], str | None]:
    """(records, failure): the plan's records, or all of them failed when the warm-up
    request failed (run_llama_server raises then: nothing was measured)."""
    import httpx

    try:
        return asyncio.run(run_llama_server(url, plan, progress=progress)), None
    except httpx.HTTPError as e:
        reason = f"llama-server failed the warm-up request: {type(e).__name__}: {e}"
        return failed_records(plan, reason), reason


def _built_version(binary: Path) -> str | None:
    stamp = binary.parent / "LLAMA_CPP_PYTHON_VERSION"
    return stamp.read_text().strip() if stamp.is_file() else None


def build_info(binary: Path) -> dict | None:
    """What scripts/build_llama_server kept (BUILD.json beside the binary), if it wrote it."""
    info = binary.parent / "BUILD.json"
    try:
        return json.loads(info.read_text()) if info.is_file() else None
    except (OSError, ValueError):
        return None
