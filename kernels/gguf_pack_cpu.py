"""A GGUF tensor's raw block rows packed for our linear kernels in one C++ pass.

``kernels.gguf_pack.pack_gguf`` calls this for the block formats (q4_k, q6_k, i8_k, q8_0,
q4_1); its numpy path is the reference, and the tests hold the two equal bit for bit. The
numpy path decodes every weight into int16 tensors and moves them through several copies:
0.02-0.03 GB of file a second on the 2-core Zen 4, minutes for an 8B file. This decodes a
block at a time and writes it straight into the panels (``kernels/csrc/gguf_pack_cpu.cpp``).

Source: ``kernels/csrc/gguf_pack_cpu.cpp``, built once per machine with ``-march=native`` by
``kernels.cpu_build`` (g++ on first use, cached under ``$CONVEYOR_CACHE_DIR/kernels``, loaded
with ctypes, torch's OpenMP pool shared).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary
from kernels.quant_pack import PAD, PackedWeight

SOURCE = Path(__file__).parent / "csrc" / "gguf_pack_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17")
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The block types the kernel decodes, in its enum's order."""
FORMATS = ("q4_k", "q6_k", "i8_k", "q8_0", "q4_1", "q5_k", "q4_0")
"""The formats it writes, in its enum's order."""

__all__ = ["FORMATS", "KernelBuildError", "LIBRARY", "build_problem", "pack_blocks"]


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.conveyor_pack_gguf.argtypes = [p, i64, i64, i32, i64, i32, i64, i64, p, p, p, p, p]
    lib.conveyor_pack_gguf.restype = i32


LIBRARY = KernelLibrary(CppKernel("gguf_pack_cpu", SOURCE, CXX_FLAGS), _setup)
"""The packer's library, built and loaded on first use."""


def build_problem() -> str | None:
    """Why the packer cannot be built or loaded here, or None when it can."""
    return LIBRARY.problem()


Allocate = Callable[[Sequence[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor]]
"""(shape, dtype) of each output -> empty contiguous CPU tensors of those (e.g. carved out of
one huge-page arena: ``service.worker.huge_pages.empty_on_huge_pages``)."""


def _empty(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def pack_blocks(parts: Sequence[tuple[str, torch.Tensor]], fmt: str, k: int, super_group: int,
                bias: torch.Tensor | None, allocate: Allocate | None = None) -> PackedWeight:
    """The parts' rows, in order, as a PackedWeight of `fmt` (one of FORMATS).

    parts: (GGUF type name in TYPES, raw [N_i, row_bytes_i] uint8 CPU, C-contiguous), every
        part of K weights a row and a type `fmt` serves (``kernels.gguf_pack.gguf_format``).
    k: input features (weights a row).
    super_group: i8_k's weights per d / dmin (256, or 32 with a legacy type in the mix);
        ignored by the other formats.
    bias: [sum N_i] float or None.
    allocate: where the packed tensors (bias included) live (default: ``torch.empty``).

    Equal bit for bit to ``kernels.gguf_pack``'s numpy path. Raises ValueError for a type,
    format or shape outside the above, or a Q4_0 block whose -8 d is beyond fp16 (as the
    numpy path does); KernelBuildError when the packer cannot be built.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    n = sum(raw.shape[0] for _, raw in parts)
    if not parts or any(t not in TYPES for t, _ in parts):
        raise ValueError(f"GGUF types must be among {TYPES}, got {[t for t, _ in parts]}")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be float [out] = [{n}], got {bias.dtype} {tuple(bias.shape)}")
    np_, p = -(-n // PAD) * PAD, -(-n // PAD)
    sg = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "i8_k": super_group}.get(fmt, 0)
    group = {"q4_k": 32, "q5_k": 32, "q6_k": 16, "i8_k": 16, "q8_0": 32, "q4_1": 32,
             "q4_0": 32}[fmt]
    u8, i8, f16 = torch.uint8, torch.int8, torch.float16
    specs = {  # name -> ([Np/64, columns, 64], dtype), the PackedWeight's tensors
        "data": ((p, {"q4_k": k // 2, "q4_1": k // 2, "q4_0": k // 2, "q6_k": 3 * k // 4,
                      "q5_k": 5 * k // 8}.get(fmt, k), PAD),
                 i8 if fmt in ("i8_k", "q8_0") else u8),
        "scale": ((p, k // group, PAD),
                  {"q4_k": u8, "q5_k": u8, "q6_k": i8, "i8_k": i8}.get(fmt, f16))}
    if fmt in ("q4_k", "q5_k", "i8_k", "q4_1"):
        specs["minv"] = ((p, k // group, PAD),
                         {"q4_k": u8, "q5_k": u8, "i8_k": i8}.get(fmt, f16))
    if sg:
        specs["super_scale"] = ((p, k // sg, PAD), f16)
    if fmt in ("q4_k", "q5_k", "i8_k"):
        specs["super_min"] = ((p, k // sg, PAD), f16)
    if bias is not None:
        specs["bias"] = ((np_,), torch.float32)
    out = dict(zip(specs, (allocate or _empty)(list(specs.values()))))
    for name, t in out.items():  # the padding rows (n .. Np) are zeros
        if n < np_ and name != "bias":
            t[-1, :, n % PAD:] = 0
    data, scale, minv = out["data"], out["scale"], out.get("minv")
    super_scale, super_min = out.get("super_scale"), out.get("super_min")
    fn = LIBRARY.load().conveyor_pack_gguf
    row0 = 0
    for t, raw in parts:
        if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous() or \
                raw.device.type != "cpu":
            raise ValueError(f"raw rows must be a contiguous [N, row_bytes] uint8 CPU tensor, "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        rc = fn(raw.data_ptr(), raw.shape[0], raw.shape[1], TYPES.index(t), row0,
                FORMATS.index(fmt), k, sg, data.data_ptr(), scale.data_ptr(), _ptr(minv),
                _ptr(super_scale), _ptr(super_min))
        if rc == -2:
            raise ValueError("a Q4_0 block's -8 d is beyond fp16: not servable as q4_1")
        if rc != 0:
            raise ValueError(f"GGUF {t} rows of {raw.shape[1]} bytes cannot be packed as {fmt}"
                             f"{f' (super group {sg})' if fmt == 'i8_k' else ''}")
        row0 += raw.shape[0]
    for name, t in (("d", super_scale), ("dmin", super_min)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{fmt}: {name} must be finite")
    padded_bias = out.get("bias")
    if padded_bias is not None:
        padded_bias[n:] = 0
        padded_bias[:n] = bias.detach().float()  # type: ignore[union-attr]
    return PackedWeight(fmt, n, k, data, scale, minv, padded_bias, group, super_scale,
                        super_min, sg)
