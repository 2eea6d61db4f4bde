"""`scripts/bench --real-sizes`: Conveyor beside llama.cpp's llama-server on the same GGUF
files, served as they are (no conversion), one table from one invocation.

    scripts/bench --real-sizes --model A.gguf --model B.gguf --peer llama-server \\
        --json docs/perf/DATE/real-sizes.json

For each file, one fresh `conveyor serve --model FILE` (`ServerProcess`) and then, with
--peer llama-server, one fresh `llama-server -m FILE` (`LlamaServerProcess`), never both at
once. On each: load time (process start -> /health 200), then the phases of
`real_sizes_plan` (one user, N at once, a cold long prompt) through the bench's own clients
(Conveyor's WebSocket runner, llama_client's streamed /v1/completions), then VmHWM from
/proc/PID/status, then the server is stopped. Both get the same threads and the same
context (`real_sizes_plan`), greedy, ignore_eos. Figures and table: `real_sizes_figures`.

A server that fails to start, dies, or fails requests is a FAILED row (what happened
named), never left out; the other rows are still measured. Exit status: 0 when every row
was measured in full, 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import asyncio
import datetime
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from service.bench.llama_client import run_llama_server
from service.bench.llama_peer import LlamaPeerOptions, build_info
from service.bench.llama_server import ROOT, LlamaServerProcess, gguf_file_type
from service.bench.machine import flags_text, machine_info
from service.bench.plan import LoadPlan
from service.bench.real_sizes_args import build_parser, check_args, phases_of
from service.bench.real_sizes_figures import Figures, Row, file_ratios, format_table, parse_vmhwm
from service.bench.real_sizes_plan import PHASES, Phases, build_phases
from service.bench.record import RequestRecord
from service.bench.report import write_json
from service.bench.run_result import RunResult
from service.bench.runner import run_server
from service.bench.server_process import HealthCheckedProcess, ServerProcess, exit_text

SCHEMA = "conveyor-bench-real-sizes/1"
HEALTH_POLL_S = 0.05  # both servers polled alike, so load time is comparable
VMHWM_NOTE = ("VmHWM: the server process's peak resident set, read from /proc/PID/status "
              "just before it was stopped; it counts file-backed mapped pages (a memory-mapped "
              "GGUF) as well as anonymous memory")

KV_NOTE = ("KV element type: each server's default (Conveyor: the model's --dtype, float32 "
           "on the CPU; llama-server: f16) unless --server-args / --llama-server-args set it")

PhaseRunner = Callable[[HealthCheckedProcess, LoadPlan, str], list[RequestRecord]]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        cfg = check_args(a)
        binary = LlamaPeerOptions(binary=a.llama_server_bin).resolve_binary() if a.peer else None
    except ValueError as e:
        print(f"conveyor bench --real-sizes: {e}", file=sys.stderr)
        return 2
    from service.bench.tokenizer import load_tokenizer
    from service.worker.cpu_threads import default_num_threads
    from service.worker.loader import default_model_path

    models = a.model or [str(default_model_path())]
    chosen = phases_of(a)
    threads = a.num_threads or default_num_threads()
    machine = machine_info(ROOT)
    cpu = machine["cpu"]
    _say(f"CPU {cpu['model_name']} ({flags_text(cpu)}; torch {machine['torch_cpu_capability']}), "
         f"commit {machine['commit']}, {threads} thread(s) per server")
    rows: list[Row] = []
    files, details = [], []
    for model in models:
        _say(f"{model}: loading its tokenizer ...")
        phases = build_phases(load_tokenizer(model), cfg)
        files.append(_file_info(model, phases))
        targets: list[tuple[str, Callable[[], HealthCheckedProcess], PhaseRunner]] = [
            ("conveyor", lambda model=model, phases=phases: _conveyor(model, phases, threads, a),
             _run_conveyor(a.no_progress))]
        if binary is not None:
            targets.append(("llama-server", lambda model=model, phases=phases: _llama(
                binary, model, phases, threads, a),
                            _run_llama(a.no_progress)))
        for server_name, make_server, run_phase in targets * a.repeat:
            server = make_server()
            _say(f"{Path(model).name}: {server_name}: {shlex.join(server.argv)}")
            row, detail = measure(Path(model).name, server_name, server, phases, run_phase,
                                  chosen)
            if server_name == "llama-server":
                detail["target"]["build"] = build_info(binary)
            rows.append(row)
            details.append(detail)
            _say(f"{row.file} {row.server}: {row.figures}; load average {detail['loadavg']}"
                 + (f" FAILED: {row.failure}" if row.failure else ""))
    table = format_table(rows, concurrent=cfg.concurrent, long_prompt=cfg.long_prompt)
    print(table)
    print(VMHWM_NOTE)
    print(f"context, both servers: {files[0]['n_seqs']} sequences x {files[0]['slot_ctx']} "
          f"tokens = {files[0]['ctx_total']} tokens of KV; {threads} threads; greedy, ignore_eos; "
          f"{KV_NOTE}")
    if a.json:
        write_json(a.json, {"schema": SCHEMA, "created": _now(), "argv": argv,
                            "machine": machine, "threads": threads, "config": asdict(cfg),
                            "files": files, "table": table.splitlines(),
                            **_rows_json(rows, details)})
        _say(f"wrote {a.json}")
    return 1 if any(r.failure for r in rows) else 0


def _rows_json(rows: list[Row], details: list[dict]) -> dict[str, object]:
    """The rows (figures, failure, target, each phase's run), the ratios and the notes."""
    return {"notes": {"vmhwm": VMHWM_NOTE, "kv": KV_NOTE, "ratios": "conveyor / llama-server",
                      "one_user_tok_s": "output tokens / duration of the sequential requests"},
            "rows": [{"file": r.file, "server": r.server, "figures": r.figures.to_json(),
                      "failure": r.failure, **d} for r, d in zip(rows, details)],
            "ratios": file_ratios(rows)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def measure(file: str, server_name: str, server: HealthCheckedProcess, phases: Phases,
            run_phase: PhaseRunner, chosen: Sequence[str] = PHASES) -> tuple[Row, dict]:
    """Start `server` (timing it), run the `chosen` phases, read VmHWM, stop it. Returns the
    row and its JSON details (target, each phase's run). A failure ends the row there."""
    server.poll_s = HEALTH_POLL_S
    detail: dict = {"target": {"argv": server.argv, "server_log": server.log_path}, "phases": {},
                    "loadavg": {"start": read_loadavg()}}  # a busy machine shows here
    t0 = time.perf_counter()
    try:
        server.start()
    except RuntimeError as e:  # exited or never healthy; the message carries the log's tail
        rc = server.exited()
        server.close()
        detail["target"]["exit_code"] = rc
        reason = str(e).split("\n")[0].rstrip(":")
        return Row(file, server_name, Figures(), f"{reason} (log: {server.log_path})"), detail
    load_s = time.perf_counter() - t0
    runs: dict[str, RunResult] = {}
    failure = vmhwm = None
    try:
        for phase in chosen:
            try:
                records = run_phase(server, getattr(phases, phase), f"{server_name} {phase}")
            except Exception as e:  # noqa: BLE001 - the client's errors vary; the row says which
                failure = f"{phase}: {type(e).__name__}: {e}"
                break
            run = RunResult(phase, "conveyor" if server_name == "conveyor" else server_name,
                            records)
            run.compute(None)
            runs[phase] = run
            detail["phases"][phase] = run.to_json()
            failure = _phase_failure(phase, run)
            if failure:
                break
        if "long" in runs:  # not 0: the long prompt hit a prefix cache, its TTFT is not cold
            detail["long_cached_tokens"] = runs["long"].records[0].cached_tokens
            if detail["long_cached_tokens"]:
                _say(f"{file} {server_name}: WARNING: the long prompt reused "
                     f"{detail['long_cached_tokens']} cached tokens")
        detail["loadavg"]["end"] = read_loadavg()
        rc = server.exited(wait_s=0.0 if failure is None else 2.0)
        if rc is None:
            vmhwm = read_vmhwm(server.proc.pid)
        else:
            detail["target"]["exit_code"] = rc
            failure = f"{server_name} died: {exit_text(rc)}" + (f" ({failure})" if failure else "")
    finally:
        server.close()
    if failure:
        failure += f" (log: {server.log_path})"
    return Row(file, server_name, figures_of(load_s, runs, vmhwm), failure), detail


def figures_of(load_s: float, runs: dict[str, RunResult], vmhwm: int | None) -> Figures:
    """The row's figures from the phases that were measured (real_sizes_figures)."""
    def metric(phase: str, get):
        run = runs.get(phase)
        return None if run is None or run.metrics.completed == 0 else get(run.metrics)

    return Figures(load_s=load_s,
                   itl_p50_ms=metric("one_user", lambda m: m.itl_ms.median),
                   one_user_tok_s=metric("one_user", lambda m: m.output_tokens_per_s),
                   concurrent_tok_s=metric("concurrent", lambda m: m.output_tokens_per_s),
                   long_ttft_ms=metric("long", lambda m: m.ttft_ms.median),
                   vmhwm_mib=None if vmhwm is None else vmhwm / 2**20)


def read_vmhwm(pid: int) -> int | None:
    """Bytes of the process's VmHWM, or None when it cannot be read (it has exited)."""
    try:
        return parse_vmhwm(Path(f"/proc/{pid}/status").read_text())
    except (OSError, ValueError):
        return None


def read_loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (/proc/loadavg), or None where unreadable."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def _phase_failure(phase: str, run: RunResult) -> str | None:
    bad = [r for r in run.records if not r.ok]
    if not bad:
        return None
    return f"{phase}: {len(bad)} of {len(run.records)} requests failed (first: {bad[0].error})"


def _conveyor(model: str, phases: Phases, threads: int, a) -> ServerProcess:
    args = ["--model", model, "--num-threads", str(threads), "--swap-space", "0",
            *phases.conveyor_args(), *shlex.split(a.server_args)]
    return ServerProcess(args, start_timeout_s=a.server_start_timeout)


def _llama(binary: Path, model: str, phases: Phases, threads: int, a) -> LlamaServerProcess:
    return LlamaServerProcess(binary, model, n_parallel=phases.n_seqs, slot_ctx=phases.slot_ctx,
                              threads=threads, extra_args=shlex.split(a.llama_server_args),
                              start_timeout_s=a.server_start_timeout)


def _run_conveyor(no_progress: bool) -> PhaseRunner:
    def run(server, plan, desc):
        return asyncio.run(run_server(server.url, plan, progress=not no_progress, desc=desc))
    return run


def _run_llama(no_progress: bool) -> PhaseRunner:
    def run(server, plan, desc):
        return asyncio.run(run_llama_server(server.base_url, plan, progress=not no_progress,
                                            desc=desc))
    return run


def _file_info(model: str, phases: Phases) -> dict[str, object]:
    path = Path(model)
    return {"name": path.name, "path": str(path.resolve()), "size_bytes": path.stat().st_size,
            "file_type": gguf_file_type(path), "slot_ctx": phases.slot_ctx,
            "n_seqs": phases.n_seqs, "ctx_total": phases.ctx_total,
            "prompt_tokens": {p: [s.input_len for s in getattr(phases, p).requests]
                              for p in PHASES},
            "max_tokens": {p: [s.max_tokens for s in getattr(phases, p).requests]
                           for p in PHASES}}


def _say(text: str) -> None:
    print(f"conveyor bench --real-sizes: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
