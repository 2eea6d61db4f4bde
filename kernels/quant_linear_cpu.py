"""Linear layers with fp32, int8 or int4 weights (scales in fp32, or fp16 as in GGUF's Q4_1 /
Q8_0 blocks, or GGUF's K-quant super-blocks: q4_k, i8_k, q6_k) on the CPU: our C++ kernels.

At one to a few rows a decode step's linear layers stream every weight from memory, so
weights that are 4 or 8 times smaller and dequantized on the fly in registers (llama.cpp's
approach) are the classic win; at hundreds of rows the product is compute-bound and
``dequantize`` + ``F.linear`` (MKL) may serve better. Which is faster on a machine is
measured, never assumed (``service.worker.quantization.choice``).

Source: ``kernels/csrc/quant_linear_cpu.cpp``, built by ``kernels.cpu_build`` in two
variants with explicit flags: ``avx512`` (AVX-512 F/BW/VL/DQ) and ``avx2`` (AVX2 + FMA + F16C); a
variant is offered where the CPU runs it, so an AVX-512 CPU can test and time both. On an AMX
CPU a third, ``amx`` (``ACT16_VARIANTS``), serves the int16-activation formats on AMX-INT8
tiles; ``amxemu`` (``TEST_VARIANTS``) is that code over a scalar model of the tiles, for the
tests. All
compute every output element with the same sequence of fp32 roundings (fma over k in
order), independent of the row count, the tiling and the threads: their outputs are
bit-identical, and a row's output never depends on the other rows of the call.

Weights come packed by ``kernels.quant_pack`` (formats, layout, torch references).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import torch

from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary
from kernels.packed_parts import AnyPacked, PackedParts
from kernels.quant_pack import PackedWeight

SOURCE = Path(__file__).parent / "csrc" / "quant_linear_cpu.cpp"
_BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17", "-ffp-contract=off")
VARIANTS: dict[str, CppKernel] = {
    "avx512": CppKernel("quant_linear_cpu-avx512", SOURCE,
                        _BASE_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                                       "-mavx2", "-mfma", "-mf16c"),
                        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma",
                                   "f16c"})),
    "avx2": CppKernel("quant_linear_cpu-avx2", SOURCE,
                      _BASE_FLAGS + ("-mavx2", "-mfma", "-mf16c"),
                      frozenset({"avx2", "fma", "f16c"})),
}
"""Builds of the kernel by instruction set; ``requires``: the CPU flags each needs."""
_AVX512_REQUIRES = VARIANTS["avx512"].requires
ACT16_VARIANTS: dict[str, CppKernel] = {
    "amx": CppKernel("quant_linear_cpu-amx", SOURCE,
                     VARIANTS["avx512"].cxx_flags + ("-mamx-tile", "-mamx-int8", "-DCONVEYOR_AMX"),
                     _AVX512_REQUIRES | {"avx512_vnni", "amx_tile", "amx_int8"}),
}
"""Builds offered for the int16-activation formats (x16) only: ``amx`` is the avx512 build
whose x16 calls of 16 rows or more run on AMX-INT8 tiles (the same bits; fewer rows take the
avx512 code). It serves only where the OS grants the tile state and the tiles' self-check
passes (``conveyor_amx_init``); every other call of it is the avx512 build's."""
TEST_VARIANTS: dict[str, CppKernel] = {
    "amxemu": CppKernel("quant_linear_cpu-amxemu", SOURCE,
                        VARIANTS["avx512"].cxx_flags + ("-DCONVEYOR_AMX", "-DCONVEYOR_AMX_EMULATE"),
                        _AVX512_REQUIRES | {"avx512_vnni"}),
}
"""Builds for the tests only, never offered to serve: ``amxemu`` runs the amx build's tile
code on a scalar model of the AMX instructions, so that any AVX512-VNNI CPU checks its
bits."""
FORMAT_CODES = {"f32": 0, "int8": 1, "int4": 2, "q4_1": 3, "q8_0": 4, "q4_1x8": 5, "q8_0x8": 6,
                "q4_1x16": 7, "q8_0x16": 8, "q4_k": 9, "i8_k": 10, "q4_kx16": 11, "i8_kx16": 12,
                "q6_k": 13, "q6_kx16": 14, "q5_k": 15, "q5_kx16": 16,
                "q4_0": 3, "q4_0x8": 5, "q4_0x16": 7}
"""``conveyor_qlinear_ex``'s ``fmt`` argument per ``PackedWeight.fmt``; q4_1 and q8_0 pass
their fp16 ``scale`` / ``minv`` tensors' pointers where the C signature says ``const
float*`` (q4_0 is q4_1's code with a null ``minv``: the kernel forms its min -8 d), q4_k, q5_k and i8_k their sc / m bytes (and d / dmin as ``sup_scale`` / ``sup_min``),
q6_k its sc bytes (and d as ``sup_scale``)."""

__all__ = ["ACT16_VARIANTS", "FORMAT_CODES", "KernelBuildError", "TEST_VARIANTS", "VARIANTS",
           "available_isas", "dequantize",
           "entry_point", "format_code", "isa_problem", "library", "quant_linear"]


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.conveyor_qlinear.argtypes = [i32, p, i64, i64, i64, i64, i64, p, p, p, i64, p, p, i64,
                                     i32]
    lib.conveyor_qlinear.restype = i32
    lib.conveyor_qdequant.argtypes = [i32, p, p, p, i64, i64, i64, i64, p, i32]
    lib.conveyor_qdequant.restype = i32
    lib.conveyor_qlinear_ex.argtypes = [i32, p, i64, i64, i64, i64, i64, p, p, p, i64, p, p, i64,
                                        p, p, i64, i32]
    lib.conveyor_qlinear_ex.restype = i32
    lib.conveyor_qdequant_ex.argtypes = [i32, p, p, p, i64, p, p, i64, i64, i64, i64, p, i32]
    lib.conveyor_qdequant_ex.restype = i32
    lib.conveyor_qlinear_isa.argtypes = []
    lib.conveyor_qlinear_isa.restype = ctypes.c_char_p


AMX_INIT_PROBLEMS = {1: "the OS did not grant the AMX tile state (arch_prctl; Linux 5.16+)",
                     2: "no AVX512-VNNI to check the AMX tiles against",
                     3: "the AMX tiles' self-check gave other bits than the VNNI tiles"}
"""``conveyor_amx_init``'s refusals."""


_CHILD_CHECK = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
                "sys.exit(lib.conveyor_amx_init())")


def _setup_tiles(lib: ctypes.CDLL) -> None:
    """_setup, then the tile state and the tiles' self-check (``conveyor_amx_init``): first in
    a child process (instructions never run on this machine before cannot take the server
    down: a fault there only refuses the build), then in this one. Raises KernelBuildError
    when either fails: the build is then not offered."""
    _setup(lib)
    try:
        child = subprocess.run([sys.executable, "-c", _CHILD_CHECK, lib._name],
                               capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the AMX tiles' self-check could not run in a child: {e}") from e
    if child.returncode != 0:
        raise KernelBuildError(AMX_INIT_PROBLEMS.get(
            child.returncode, f"the AMX tiles' self-check failed in a child process (exit "
                              f"{child.returncode}: a negative one is a signal)"))
    lib.conveyor_amx_init.argtypes = []
    lib.conveyor_amx_init.restype = ctypes.c_int
    rc = lib.conveyor_amx_init()
    if rc != 0:
        raise KernelBuildError(AMX_INIT_PROBLEMS.get(rc, f"conveyor_amx_init returned {rc}"))


_LIBRARIES = {isa: KernelLibrary(kernel, _setup) for isa, kernel in VARIANTS.items()}
_LIBRARIES.update({isa: KernelLibrary(kernel, _setup_tiles)
                   for isa, kernel in (*ACT16_VARIANTS.items(), *TEST_VARIANTS.items())})


def isa_problem(isa: str) -> str | None:
    """Why the `isa` build cannot serve here (CPU lacks it, no compiler, ...), or None.
    Builds it on the first call (a few seconds). Raises ValueError for an unknown isa."""
    if isa not in _LIBRARIES:
        raise ValueError(f"isa must be one of {tuple(_LIBRARIES)}, got {isa!r}")
    problem = _LIBRARIES[isa].problem()
    if problem is None and _LIBRARIES[isa].load().conveyor_qlinear_isa().decode() != isa:
        return f"the {isa} build reports another instruction set"  # a broken flag set
    return problem


def available_isas() -> tuple[str, ...]:
    """The builds that run on this CPU and build here, fastest instruction set first."""
    return tuple(isa for isa in VARIANTS if isa_problem(isa) is None)


def library(isa: str) -> KernelLibrary:
    """The `isa` build's library (not loaded yet, perhaps). Raises ValueError for an unknown
    isa."""
    if isa not in _LIBRARIES:
        raise ValueError(f"isa must be one of {tuple(_LIBRARIES)}, got {isa!r}")
    return _LIBRARIES[isa]


def _library(isa: str) -> ctypes.CDLL:
    if isa not in _LIBRARIES:
        raise ValueError(f"isa must be one of {tuple(_LIBRARIES)}, got {isa!r}")
    return _LIBRARIES[isa].load()


def entry_point(isa: str) -> int:
    """Address of the `isa` build's ``conveyor_qlinear_ex`` (the fused forward calls it by
    pointer). Raises ValueError for an unknown isa, KernelBuildError when it is unavailable."""
    return ctypes.cast(_library(isa).conveyor_qlinear_ex, ctypes.c_void_p).value


def format_code(fmt: str) -> int:
    """The C kernel's code for a ``PackedWeight.fmt``. Raises KeyError for an unknown one."""
    return FORMAT_CODES[fmt]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_linear(x: torch.Tensor, packed: AnyPacked, isa: str,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` with W (and the bias) from `packed`.

    Args:
        x: [M, K] float32 on the CPU, unit stride along K (rows may be further apart, e.g. a
            slice of a fused projection). M may be 0.
        packed: the weight, from ``kernels.quant_pack.pack_*``, or a split weight
            (``kernels.packed_parts.PackedParts``: one kernel call a part, each writing its
            columns of y).
        isa: the build to use: one of ``available_isas()``, for an x16 format also an
            ``ACT16_VARIANTS`` build that loads here, or a ``TEST_VARIANTS`` build.
        out: [M, N] float32 with unit stride along N to write into, or None (a new tensor).

    Returns:
        [M, N] float32. Row m depends on x[m] alone: the same bits whatever the other rows.

    Raises:
        ValueError: a dtype, device, shape or stride outside the above; an unknown isa.
        KernelBuildError: the build for `isa` cannot be built or loaded here.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 CPU tensor [M, K], got {x.dtype} shape "
                         f"{tuple(x.shape)} on {x.device}")
    m, k = x.shape
    n = packed.out_features
    if k != packed.in_features:
        raise ValueError(f"x has {k} input features, the weight {packed.in_features}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        raise ValueError(f"x needs unit stride along K and rows at least K apart, strides {x.stride()}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != (m, n)
          or (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n)):
        raise ValueError(f"out must be float32 [M, N] = [{m}, {n}] on the CPU with unit stride "
                         f"along N, got {out.dtype} shape {tuple(out.shape)} strides {out.stride()}")
    if m == 0:
        return out
    if isinstance(packed, PackedParts):
        col = 0
        for part in packed.parts:
            quant_linear(x, part, isa, out[:, col:col + part.out_features])
            col += part.out_features
        return out
    fn = _library(isa).conveyor_qlinear_ex
    rc = fn(FORMAT_CODES[packed.fmt], x.data_ptr(), max(x.stride(0), k), m, k, n,
            packed.padded_out, packed.data.data_ptr(), _ptr(packed.scale), _ptr(packed.minv),
            packed.group, _ptr(packed.super_scale), _ptr(packed.super_min), packed.super_group,
            _ptr(packed.bias), out.data_ptr(), max(out.stride(0), n), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"quantized linear kernel rejected its arguments (code {rc}): "
                         f"{packed.fmt} [{n}, {k}], x {tuple(x.shape)}")
    return out


def dequantize(packed: AnyPacked, isa: str) -> torch.Tensor:
    """[N, K] float32: the weight of `packed` as the kernel multiplies by it (``unpack`` in
    ``kernels.quant_pack`` is the reference; a split weight: its parts' rows in order),
    computed with the OpenMP pool.

    Raises ValueError for an unknown isa, KernelBuildError when its build is unavailable."""
    if isinstance(packed, PackedParts):
        return torch.cat([dequantize(p, isa) for p in packed.parts])
    out = torch.empty(packed.out_features, packed.in_features, dtype=torch.float32)
    rc = _library(isa).conveyor_qdequant_ex(
        FORMAT_CODES[packed.fmt], packed.data.data_ptr(), _ptr(packed.scale), _ptr(packed.minv),
        packed.group, _ptr(packed.super_scale), _ptr(packed.super_min), packed.super_group,
        packed.in_features, packed.out_features, packed.padded_out, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"dequantize rejected its arguments (code {rc})")
    return out
