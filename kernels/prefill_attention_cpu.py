"""Causal paged attention of a prefill chunk on the CPU: a small C++ kernel, built on first use.

A mixed step's prefill chunks (hundreds of query rows of one sequence) were attended with
``scaled_dot_product_attention`` on K/V gathered out of the paged cache; this kernel reads
K/V straight from the cache through the block table and computes the chunk as
FlashAttention-2 does (online softmax over one cache block of keys at a time; Dao 2023),
with GQA's query heads sharing their KV head's blocks (never expanded). Measured on the
2-core Zen 3 (AVX2) reference machine: see ``kernels/csrc/prefill_attention_cpu.cpp``.

Where the CPU multiplies bf16 in hardware (AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids
and later), ``bf16_dot=True`` computes Q K^T and P V as bf16 products summed in fp32
(``vdpbf16ps``: twice an fp32 FMA's multiply-adds an instruction); the softmax stays fp32.
``bf16_dot_available()`` is the run check; without it (an AVX2 or AVX-512 CPU without BF16,
or under an ISA cap) only fp32 products exist.

Source: ``kernels/csrc/prefill_attention_cpu.cpp``, built once per machine with
``-march=native`` by ``kernels.cpu_build`` (g++ on first use, cached under
``$CONVEYOR_CACHE_DIR/kernels``, loaded with ctypes, torch's OpenMP pool shared).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_attention_io import KV_DTYPES, check_dtypes, kv_dtype_code
from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary, cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
"""Compile flags: -ffast-math lets the softmax's exp vectorise (glibc's libmvec; with
-fno-finite-math-only it stays scalar, a third of the kernel's time; its argument is clamped
so that no lane takes libmvec's scalar path: ``kernels/csrc/softmax_exp.h``); masked keys and
the first running max use a large finite negative instead of -inf."""
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_BLOCK_SIZE = 64
BF16_DOT_BOUND = 2e-2
"""atol and rtol of ``bf16_dot=True`` against the fp32 reference (``paged_attention_ref``):
the project's bound for 16-bit types (tests/kernels/conftest.py). Rounding q, k, v and the
probabilities to bf16 (8 significant bits, unit roundoff 2^-8) moves a score by at most
2^-7 scale sum_d |q_d k_d| and an output by at most about 2^-7 max |v| beyond that."""

BF16_DOT_MIN_CONTEXT = 1024
"""Contexts (tokens, the chunk's own included) from which a plan with ``prefill_bf16_dot``
uses the bf16 products (``kernels.paged_attention_cpu``). Below it a step's attention is a
small share and bf16 gains little (Zen 4, one thread: a 512-token chunk at position 0 took
4.1 ms against 5.1 in fp32, at 3,072 tokens 26 against 49, at 6,000 52-57 against 107-112),
so short prompts keep the fp32 kernel's bits."""

__all__ = ["BF16_DOT_BOUND", "BF16_DOT_MIN_CONTEXT", "KV_DTYPES", "KernelBuildError", "LIBRARY",
           "bf16_dot_available", "build_problem", "prefill_attention_cpu", "supports"]


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = lib.conveyor_prefill_attention
    fn.argtypes = [i32, i32, p, i64, p, p, p, i64, i64, i64, p, i64, i64, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32
    lib.conveyor_prefill_attention_bf16_dot.argtypes = []
    lib.conveyor_prefill_attention_bf16_dot.restype = i32


LIBRARY = KernelLibrary(CppKernel("prefill_attention_cpu", SOURCE, CXX_FLAGS), _setup)
"""The kernel's library, built and loaded on first use."""


def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can."""
    return LIBRARY.problem()


def bf16_dot_available() -> bool:
    """Whether ``bf16_dot=True`` runs here: the CPU reports avx512_bf16 (``cpu_flags``, so
    never under an ISA cap that hides it) and the build has the instructions (it is compiled
    with -march=native: a CPU without them builds without that path). Builds the kernel on
    the first call; False where it does not build."""
    if "avx512_bf16" not in cpu_flags() or build_problem() is not None:
        return False
    return bool(LIBRARY.load().conveyor_prefill_attention_bf16_dot())


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
                          scale: float, bf16_dot: bool = False) -> None:
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
        bf16_dot: False: fp32 products and sums (a 16-bit cache widened exactly: the bits of
            an fp32 cache holding the widened values). True: q, K, V and each block's
            probabilities rounded to bf16 (round to nearest even), products summed in fp32
            (AVX512-BF16), within ``BF16_DOT_BOUND`` of the fp32 reference; only where
            ``bf16_dot_available()``.

    Raises:
        ValueError: a dtype, device, shape or stride outside the above, a layout the
            kernel does not support (``supports``), ctx_len < n, too few blocks, a block
            id outside the cache (checked before anything is written), or bf16_dot where
            ``bf16_dot_available()`` is False.
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
    if bf16_dot and not bf16_dot_available():
        raise ValueError("bf16_dot needs a CPU with AVX512-BF16 (and no ISA cap hiding it)")
    if n == 0:
        return
    rc = LIBRARY.load().conveyor_prefill_attention(
        kv_dtype_code(k_cache.dtype), int(bf16_dot), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
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
    5: "bf16_dot: this build of the prefill attention kernel has no AVX512-BF16 products",
}
