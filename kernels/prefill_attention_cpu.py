"""Causal paged attention of a prefill chunk on the CPU: a small C++ kernel, built on first use.

A mixed step's prefill chunks (hundreds of query rows of one sequence) were attended with
``scaled_dot_product_attention`` on K/V gathered out of the paged cache; this kernel reads
K/V straight from the cache through the block table and computes the chunk as
FlashAttention-2 does (online softmax over one cache block of keys at a time; Dao 2023),
with GQA's query heads sharing their KV head's blocks (never expanded). Measured on the
2-core Zen 3 (AVX2) reference machine: see ``kernels/csrc/prefill_attention_cpu.cpp``.

Source: ``kernels/csrc/prefill_attention_cpu.cpp``, built once per machine with
``-march=native`` by ``kernels.cpu_build`` (g++ on first use, cached under
``$CONVEYOR_CACHE_DIR/kernels``, loaded with ctypes, torch's OpenMP pool shared).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_attention_io import KV_DTYPES, check_dtypes, kv_dtype_code
from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
"""Compile flags: -ffast-math lets the softmax's exp vectorise (glibc's libmvec; with
-fno-finite-math-only it stays scalar, a third of the kernel's time); masked keys and the
first running max use a large finite negative instead of -inf."""
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_BLOCK_SIZE = 64

__all__ = ["KV_DTYPES", "KernelBuildError", "LIBRARY", "build_problem", "prefill_attention_cpu", "supports"]


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = lib.conveyor_prefill_attention
    fn.argtypes = [i32, p, i64, p, p, p, i64, i64, i64, p, i64, i64, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32


LIBRARY = KernelLibrary(CppKernel("prefill_attention_cpu", SOURCE, CXX_FLAGS), _setup)
"""The kernel's library, built and loaded on first use."""


def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can."""
    return LIBRARY.problem()


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel handles this model and cache: fp32 activations, a cache in
    KV_DTYPES (kv_dtype; None: the activations' dtype), head dim in HEAD_DIMS, Hq a
    multiple of Hkv, block_size <= MAX_BLOCK_SIZE."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (dtype == torch.float32 and kv_dtype in KV_DTYPES and head_dim in HEAD_DIMS
            and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and 1 <= block_size <= MAX_BLOCK_SIZE)


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          blocks: torch.Tensor, ctx_len: int, out: torch.Tensor,
                          scale: float) -> None:
    """Causal attention of one sequence's chunk of n query tokens, written into ``out``.

    Query i is at position ``ctx_len - n + i`` and attends to positions 0 .. ctx_len - n + i
    of the sequence (``paged_attention_ref`` for one prefill chunk); the chunk's own K/V
    must already be in the cache.

    Args:
        q: [n, Hq, D] float32 on the CPU, D and Hq * D contiguous per row (a row view of a
            fused projection is fine), n >= 1.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] float32, float16 or bfloat16
            (KV_DTYPES), one dtype, contiguous.
        blocks: [>= ceil(ctx_len / block_size)] int64, unit stride: the sequence's block ids.
        ctx_len: context length including the chunk (>= n).
        out: [n, Hq, D] float32, D and Hq * D contiguous per row.
        scale: softmax scale, usually D ** -0.5.

    Raises:
        ValueError: a dtype, device, shape or stride outside the above, a layout the
            kernel does not support (``supports``), ctx_len < n, too few blocks, or a block
            id outside the cache (checked before anything is written).
        KernelBuildError: the kernel could not be built or loaded.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"need q [n, Hq, D] and caches [num_blocks, block_size, Hkv, D] of one "
                         f"shape, got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    n, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_d = k_cache.shape
    check_dtypes(q, out, k_cache, v_cache)
    if blocks.dtype != torch.int64 or blocks.device.type != "cpu" or blocks.dim() != 1 or (
            blocks.shape[0] > 1 and blocks.stride(0) != 1):
        raise ValueError(f"blocks must be a 1-D int64 CPU tensor with unit stride, got "
                         f"{blocks.dtype} {tuple(blocks.shape)} on {blocks.device}")
    if cache_d != head_dim or not supports(q.dtype, num_q_heads, num_kv_heads, head_dim,
                                           block_size, k_cache.dtype):
        raise ValueError(f"q {tuple(q.shape)} with caches {tuple(k_cache.shape)}: need the same D "
                         f"in {HEAD_DIMS}, Hq a multiple of Hkv and block_size <= "
                         f"{MAX_BLOCK_SIZE}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} needs D and Hq * D contiguous per row, strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if n == 0:
        return
    rc = LIBRARY.load().conveyor_prefill_attention(
        kv_dtype_code(k_cache.dtype), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), blocks.data_ptr(), blocks.shape[0], n, int(ctx_len), out.data_ptr(),
        out.stride(0), num_blocks, num_q_heads, num_kv_heads, head_dim, block_size,
        float(scale), torch.get_num_threads())
    if rc != 0:
        raise ValueError(_KERNEL_ERRORS.get(rc, f"prefill attention kernel error {rc}"))


_KERNEL_ERRORS = {
    1: "prefill attention kernel: unsupported cache dtype, head layout or block size, or a "
       "non-positive size",
    2: "ctx_len must be >= the chunk's rows, and blocks must cover ctx_len",
    4: "blocks holds a block id outside the cache among the blocks the context needs",
}
