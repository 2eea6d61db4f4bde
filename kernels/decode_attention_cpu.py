"""Paged decode attention on the CPU: a small C++ kernel, built on first use.

Decode rows (one query token per sequence) are most of a CPU step's attention
time. The torch path (``paged_attention_cpu``) gathers each group's K/V blocks
into a padded copy and calls ``scaled_dot_product_attention``; this kernel
reads K/V straight from the paged cache through the block table (as vLLM's CPU
backend and llama.cpp do) and vectorises the softmax's exp. On the 2-core
reference machine (``scripts/bench --engine-only --cpu-decode-kernel cpp,sdpa``,
int8, contexts of about 300 tokens) a decode step's attention took 10.7 ms
instead of 25.9 at 16 sequences and 38.3 instead of 100.8 at 64.

Source: ``kernels/csrc/decode_attention_cpu.cpp``, built once per machine with
``-march=native`` by ``kernels.cpu_build`` (g++ on first use, cached under
``$CONVEYOR_CACHE_DIR/kernels``, loaded with ctypes, torch's OpenMP pool shared).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_attention_io import KV_DTYPES, check_dtypes, kv_dtype_code
from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary

SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
"""Compile flags. -ffast-math lets the softmax's exp vectorise (glibc's libmvec, on a clamped
argument so that no lane takes its scalar path: ``kernels/csrc/softmax_exp.h``); it is given
to the compile step only (see ``kernels.cpu_build.CppKernel``)."""
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_GQA_GROUP = 64

__all__ = ["KV_DTYPES", "KernelBuildError", "LIBRARY", "build_problem", "decode_attention_cpu",
           "entry_point", "kernel_available", "kernel_error", "load_kernel", "supports"]


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = lib.conveyor_decode_attention
    fn.argtypes = [i32, p, i64, p, p, p, i64, i64, p, p, p, i64, i64, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32


LIBRARY = KernelLibrary(CppKernel("decode_attention_cpu", SOURCE, CXX_FLAGS), _setup)
"""The kernel's library, built and loaded on first use (``LIBRARY.reset(error)`` in tests)."""


def load_kernel() -> ctypes.CDLL:
    """Build (once per machine) and load the kernel library; cached per process.

    Raises:
        KernelBuildError: no compiler, a compile error, or the library does not load.
            The failure is remembered: later calls raise it again without rebuilding.
    """
    return LIBRARY.load()


def kernel_available() -> bool:
    """Whether the kernel builds and loads here (builds it on the first call)."""
    return build_problem() is None


def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can."""
    return LIBRARY.problem()


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
             kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel handles this model: fp32 activations, a cache in KV_DTYPES
    (kv_dtype; None: the activations' dtype), head dim in HEAD_DIMS, G = Hq / Hkv <= 64."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (dtype == torch.float32 and kv_dtype in KV_DTYPES and head_dim in HEAD_DIMS
            and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= MAX_GQA_GROUP)


def entry_point() -> ctypes._CFuncPtr:
    """The kernel's C function ``conveyor_decode_attention`` from the loaded library; its
    first argument is the caches' dtype code (``kernels.cpu_attention_io.kv_dtype_code``).

    Raises:
        KernelBuildError: the library does not build or load.
    """
    return load_kernel().conveyor_decode_attention


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
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] float32, float16 or bfloat16
            (KV_DTYPES), one dtype, contiguous.
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
    check_dtypes(q, out, k_cache, v_cache)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("rows", rows)):
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"{name} must be int64 on the CPU, got {t.dtype} on {t.device}")
    if cache_d != head_dim or not supports(q.dtype, num_q_heads, num_kv_heads, head_dim,
                                           k_cache.dtype):
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
    rc = entry_point()(kv_dtype_code(k_cache.dtype), q.data_ptr(), q.stride(0),
                       k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                       block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(),
                       rows.data_ptr(), out.data_ptr(), out.shape[0], k_cache.shape[0], n,
                       num_q_heads, num_kv_heads, head_dim, block_size, float(scale),
                       torch.get_num_threads())
    if rc != 0:
        raise ValueError(kernel_error(rc))


def kernel_error(rc: int) -> str:
    """What the kernel's non-zero return code `rc` means."""
    return _KERNEL_ERRORS.get(rc, f"decode attention kernel error {rc}")


_KERNEL_ERRORS = {
    1: "decode attention kernel: unsupported cache dtype or head layout, or a non-positive size",
    2: "seq_lens must be >= 1 and fit block_tables' width in blocks",
    3: "rows must be distinct rows of out",
    4: "block_tables holds a block id outside the cache among the blocks a context needs",
}
