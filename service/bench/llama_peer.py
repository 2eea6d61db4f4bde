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
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass
from pathlib import Path

from service.bench.llama_client import run_llama_server
from service.bench.llama_server import (DEFAULT_BIN_DIR, LlamaServerProcess, find_llama_server,
                                        gguf_file_type, q4_model, slot_context)
from service.bench.plan import LoadPlan
from service.bench.run_result import RunResult

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
    (not yet computed). Raises ValueError / FileNotFoundError / RuntimeError when the
    server cannot be found, prepared or started."""
    if opts.url:
        records = asyncio.run(run_llama_server(opts.url, plan, progress=progress))
        return RunResult("llama-server", "llama-server", records,
                         {"url": opts.url, "notes": NOTES})
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
    with server:
        records = asyncio.run(run_llama_server(server.base_url, plan, progress=progress))
    target = {"binary": str(binary), "argv": server.argv, "server_log": server.log_path,
              "model": str(model), "source_model": str(source),
              "source_weight_type": gguf_file_type(source), "weight_type": weight_type,
              "n_parallel": slots, "slot_ctx": ctx, "threads": opts.threads, "notes": NOTES,
              "llama_cpp_python_version": _built_version(binary)}
    return RunResult("llama-server", "llama-server", records, target)


def _built_version(binary: Path) -> str | None:
    stamp = binary.parent / "LLAMA_CPP_PYTHON_VERSION"
    return stamp.read_text().strip() if stamp.is_file() else None
