"""Paged decode attention on the CPU: a small C++ kernel, built on first use.

Decode rows (one query token per sequence) are most of a CPU step's attention
time. The torch path (``paged_attention_cpu``) gathers each group's K/V blocks
into a padded copy and calls ``scaled_dot_product_attention``; this kernel
reads K/V straight from the paged cache through the block table (as vLLM's CPU
backend and llama.cpp do) and vectorises the softmax's exp. On the 2-core
reference machine (``scripts/bench --engine-only --cpu-decode-kernel cpp,sdpa``,
int8, contexts of about 300 tokens) a decode step's attention took 10.7 ms
instead of 25.9 at 16 sequences and 38.3 instead of 100.8 at 64.

Source: ``kernels/csrc/decode_attention_cpu.cpp``. It is compiled once per
machine with the system C++ compiler (``$CXX``, default ``g++``) into
``$CONVEYOR_CACHE_DIR/kernels`` (default ``$XDG_CACHE_HOME/conveyor/kernels``,
i.e. ``~/.cache/conveyor/kernels``) under a name hashed
from the source, the flags, the compiler's version and the CPU's flags, and
loaded with ctypes (no torch headers: it builds in about a second). It uses
OpenMP through the ``libgomp.so.1`` torch has already loaded, so torch and the
kernel share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
"""Compile flags. -ffast-math lets the softmax's exp vectorise (glibc's libmvec). It is
given to the compile step only: at link time it would add crtfastmath.o, whose constructor
sets flush-to-zero / denormals-are-zero for the whole process when the library loads and
so would change torch's numerics too."""
LINK_FLAGS = ("-shared", "-fopenmp")
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_GQA_GROUP = 64


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded (no compiler, a compile error, ...)."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: KernelBuildError | None = None


def _cache_dir() -> Path:
    root = os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _build(cxx: str) -> Path:
    """Compile SOURCE unless a build for this source, compiler and CPU is cached.

    cxx: the compiler command, possibly with a wrapper or arguments ("ccache g++").
    """
    words = shlex.split(cxx)
    found = shutil.which(words[0]) if words else None
    if found is None:
        raise KernelBuildError(f"C++ compiler {cxx!r} not found (set CXX or install g++)")
    compiler = [found, *words[1:]]
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    source = SOURCE.read_bytes()
    flags = " ".join(CXX_FLAGS) + " | " + " ".join(LINK_FLAGS)
    key = hashlib.sha256(b"\0".join([source, flags.encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"decode_attention_cpu-{key}.so"
    if target.exists():
        return target
    # Build beside the target and rename: concurrent builders (several servers) never
    # load a half-written library.
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel build to {out_dir} ({e}); "
                               "set CONVEYOR_CACHE_DIR to a writable folder") from e
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([*compiler, *CXX_FLAGS, "-c", str(SOURCE), "-o", obj],
                    [*compiler, *LINK_FLAGS, obj, "-o", tmp]):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                                       f"{proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o644)  # mkstemp made it 0600: let others sharing the cache load it
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {SOURCE.name} failed: {e}") from e
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def load_kernel() -> ctypes.CDLL:
    """Build (once per machine) and load the kernel library; cached per process.

    Raises:
        KernelBuildError: no compiler, a compile error, or the library does not load.
            The failure is remembered: later calls raise it again without rebuilding.
    """
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise _error
        try:
            path = _build(os.environ.get("CXX", "g++"))
            lib = ctypes.CDLL(str(path))
        except KernelBuildError as e:
            _error = e
            raise
        except OSError as e:
            _error = KernelBuildError(f"loading the decode attention kernel failed: {e}")
            raise _error from e
        fn = lib.conveyor_decode_attention_f32
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, i64, i64, p, p, p, i64, i64, i32, i32, i32, i32, i32,
                       ctypes.c_float, i32]
        fn.restype = i32
        _lib = lib
        return lib


def kernel_available() -> bool:
    """Whether the kernel builds and loads here (builds it on the first call)."""
    return build_problem() is None


def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can."""
    try:
        load_kernel()
    except KernelBuildError as e:
        return str(e)
    return None


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this model: fp32, head dim in HEAD_DIMS, G = Hq / Hkv <= 64."""
    return (dtype == torch.float32 and head_dim in HEAD_DIMS and num_kv_heads > 0
            and num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GQA_GROUP)


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Attention of n decode rows over the paged cache, written into ``out[rows]``.

    Decode i's query is ``q[rows[i]]``, at position ``seq_lens[i] - 1``, and attends
    to positions 0..seq_lens[i]-1 of its blocks (``paged_attention_ref`` for a step of
    decodes). Rows of ``out`` not in ``rows`` are left as they are.

    Args:
        q: [T, Hq, D] float32 on the CPU; D and Hq * D contiguous per row (a row view
            of a fused projection is fine).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] float32, contiguous.
        block_tables: [n, max_blocks] int64, unit stride in the last dim; row i holds
            at least ceil(seq_lens[i] / block_size) valid block ids.
        seq_lens: [n] int64 contiguous, each >= 1 (context including this token).
        rows: [n] int64 contiguous, distinct rows of q and out.
        out: [T, Hq, D] float32, contiguous.
        scale: softmax scale, usually D ** -0.5.

    Raises:
        ValueError: a dtype, device, shape or stride outside the above, a head
            layout the kernel does not support (``supports``), a seq_len < 1 or longer
            than the table, a row out of range or repeated, or a block id outside the
            cache.
        KernelBuildError: the kernel could not be built or loaded.

    The kernel checks seq_lens, rows and the block ids it will read before touching
    memory (ValueError, nothing written); entries of a table row past a context's
    blocks are not read and may hold anything.
    """
    _, num_q_heads, head_dim = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, cache_d = k_cache.shape
    n = rows.shape[0]
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be float32 on the CPU, got {t.dtype} on {t.device}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("rows", rows)):
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"{name} must be int64 on the CPU, got {t.dtype} on {t.device}")
    if cache_d != head_dim or not supports(q.dtype, num_q_heads, num_kv_heads, head_dim):
        raise ValueError(f"q {tuple(q.shape)} with caches {tuple(k_cache.shape)}: need the same D "
                         f"in {HEAD_DIMS} and Hq a multiple of Hkv with Hq / Hkv <= {MAX_GQA_GROUP}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError(f"q needs D and Hq * D contiguous per row, strides {q.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("k_cache, v_cache and out must be contiguous")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if (block_tables.dim() != 2 or block_tables.shape[0] != n or block_tables.stride(1) != 1
            or seq_lens.shape != (n,) or not seq_lens.is_contiguous() or rows.dim() != 1
            or not rows.is_contiguous()):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)} and rows {tuple(rows.shape)} must describe n "
                         "decodes ([n, max_blocks] with unit stride, [n], [n] contiguous)")
    if n == 0:
        return
    fn = load_kernel().conveyor_decode_attention_f32
    rc = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
            seq_lens.data_ptr(), rows.data_ptr(), out.data_ptr(), out.shape[0],
            k_cache.shape[0], n, num_q_heads, num_kv_heads, head_dim, block_size, float(scale),
            torch.get_num_threads())
    if rc != 0:
        raise ValueError(_KERNEL_ERRORS.get(rc, f"decode attention kernel error {rc}"))


_KERNEL_ERRORS = {
    1: "decode attention kernel: unsupported head layout or a non-positive size",
    2: "seq_lens must be >= 1 and fit block_tables' width in blocks",
    3: "rows must be distinct rows of out",
    4: "block_tables holds a block id outside the cache among the blocks a context needs",
}
