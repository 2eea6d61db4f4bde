"""A GGUF tensor's raw rows -> a packed weight (``kernels.quant_pack``) that serves the file's
dequantized values bit for bit.

Every supported block type is first read into one form, per block of ``S`` weights (256 for
the K-quants, 32 for the legacy types) and per group of 16:

    W[k] = (d * sc[g]) * q[k] - dmin * m[g]        (fp32; d, dmin fp16 per block)

which is how ggml's reference dequantizes the K-quants (``dequantize_row_q4_K`` etc. in
ggml-quants.c; gguf-py's ``gguf.quants`` the same in numpy): d * sc, dmin * m and
(d * sc) * q are exact in fp32 (at most 11 + 8 + 6 significant bits), the subtraction rounds
once. The legacy types fit it with sc = 1: Q8_0 ``d q``, Q5_0 ``d (q - 16)``, Q4_0
``d (q - 8)``, Q4_1 / Q5_1 ``d q + m`` (dmin = -m, m = 1).

| GGUF types of the parts | format | bits a weight |
|---|---|---|
| all Q4_K | q4_k | 4.625 (file 4.5) |
| all Q5_K | q5_k | 5.625 (file 5.5) |
| all Q6_K | q6_k | 6.5625 (the file's) |
| all Q4_0 | q4_0 (q4_1 without mins: the kernel forms -8 d) | 4.5 (the file's) |
| Q4_1, or Q4_1 and Q4_0 | q4_1 (Q4_0: min = -8 d, exact in fp16) | 5.0 |
| all Q8_0 / Q5_0 | q8_0 (Q5_0: q - 16) | 8.5 |
| all F32 / F16 / BF16 | f32 | 32 |
| Q2_K, Q3_K, or a mix of K-quants | i8_k, super-block 256 | 9.125 |
| Q5_1, or a mix with a legacy type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) | i8_k, super-block 32 | 10 |

A fused weight whose parts' own formats differ (Q4_K_M's qkv: Q4_K q and k, a Q6_K v) is
served split instead (``split_runs``, ``kernels.packed_parts``): each run of parts in its own
format, no more bytes than the mix's i8_k.

Other types (IQ*, TQ*, Q8_K, a float type mixed with a block type) get None from
``gguf_format``: served dequantized by the caller.

Byte layouts are ggml's ``block_q4_K`` (d, dmin, 12 bytes of 6-bit scales and mins as
``get_scale_min_k4`` unpacks them, 128 bytes of nibbles: byte i of 32-byte chunk j holds
weight 64 j + i low, 64 j + 32 + i high), ``block_q5_K``, ``block_q6_K``, ``block_q2_K``,
``block_q3_K``, ``block_q4_0`` .. ``block_q8_0`` (ggml-common.h); read here from their
documentation, checked against ``gguf.quants.dequantize`` by the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.gguf_pack_cpu import Allocate
from kernels.gguf_pack_cpu import build_problem as native_problem
from kernels.gguf_pack_cpu import pack_blocks
from kernels.quant_pack import PackedWeight, pack_f32, pack_k_blocks, pack_q4_0_blocks, \
    pack_q4_1_blocks, pack_q6_k_blocks, pack_q8_0_blocks

BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "F32": (1, 4), "F16": (1, 2),
               "BF16": (1, 2)}
"""GGUF type -> (weights a block, bytes a block), for the types served."""
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_format(types: Sequence[str]) -> str | None:
    """The packed format that serves a fused weight whose parts have these GGUF type names
    (module table), or None when none serves them exactly (or `types` is empty).
    E.g. ("Q4_K", "Q4_K", "Q4_K") -> "q4_k"; ("Q6_K",) -> "q6_k"; ("Q4_K", "Q4_K", "Q6_K") ->
    "i8_k";
    ("Q4_0",) -> "q4_1"; ("IQ2_XS",) -> None."""
    kinds = set(types)
    if not kinds or not kinds <= set(BLOCK_BYTES):
        return None
    if kinds <= set(FLOAT_TYPES):
        return "f32"
    if kinds & set(FLOAT_TYPES):
        return None
    if kinds == {"Q4_K"}:
        return "q4_k"
    if kinds == {"Q5_K"}:
        return "q5_k"
    if kinds == {"Q6_K"}:
        return "q6_k"
    if kinds == {"Q4_0"}:
        return "q4_0"
    if kinds <= {"Q4_0", "Q4_1"}:
        return "q4_1"
    if kinds <= {"Q8_0", "Q5_0"}:
        return "q8_0"
    return "i8_k"


def split_runs(types: Sequence[str]) -> list[tuple[str, list[int]]] | None:
    """How a fused weight whose parts have these GGUF types is served as a split weight
    (``kernels.packed_parts``): [(format, the parts' indices)] for each run of consecutive
    parts whose types have the same format of their own (``gguf_format`` of each), or None
    where that is one format for all, or some part has no format of ours or is a float
    type. A split never reads more bytes than one ``i8_k`` over the mix: each run's own
    format takes at most i8_k's bits. E.g. ("Q4_K", "Q4_K", "Q6_K") (Q4_K_M's qkv) -> [("q4_k", [0, 1]),
    ("q6_k", [2])]: 4.625 and 6.5625 bits a weight instead of 9.125; Q3_K_M's ("Q3_K", "Q3_K",
    "Q5_K") -> [("i8_k", [0, 1]), ("q5_k", [2])]."""
    runs: list[tuple[str, list[int]]] = []
    for i, t in enumerate(types):
        fmt = gguf_format([t])
        if fmt is None or fmt == "f32":
            return None
        if runs and fmt == runs[-1][0]:
            runs[-1][1].append(i)
        else:
            runs.append((fmt, [i]))
    return runs if len(runs) > 1 else None


def dequantize_gguf(gguf_type: str, raw: torch.Tensor) -> torch.Tensor:
    """[N, K] float32: the rows' values as gguf-py's reference dequantizes them
    (``gguf.quants.dequantize``, which matches ggml's). raw: [N, row_bytes] uint8, each row
    whole blocks. Raises ValueError for an unknown type or a bad shape."""
    import gguf

    _row_weights(gguf_type, raw)
    try:
        qtype = gguf.GGMLQuantizationType[gguf_type]
    except KeyError:
        raise ValueError(f"unknown GGUF type {gguf_type!r}") from None
    out = gguf.quants.dequantize(raw.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def pack_gguf(parts: Sequence[tuple[str, torch.Tensor]],
              bias: torch.Tensor | None = None, *, native: bool = True,
              allocate: Allocate | None = None) -> PackedWeight:
    """Pack a fused weight from its parts' raw rows, in the format ``gguf_format`` names.

    parts: (GGUF type name, raw) with raw a [N_i, row_bytes_i] uint8 CPU tensor: the
        tensor's rows exactly as in the file (whole rows may have been reordered); every
        part has the same K (input features). Output rows are the parts' rows in order.
    bias: [sum N_i] float or None.

    native: pack the block formats in one C++ pass (``kernels.gguf_pack_cpu``, 25-70 times
    faster) where it builds; False, or no compiler: this module's numpy path, the reference
    (the tests hold the two equal).
    allocate: where the native path's packed tensors live (``kernels.gguf_pack_cpu``).

    Returns a PackedWeight whose ``unpack`` equals ``dequantize_gguf`` of each part,
    concatenated, bit for bit. Raises ValueError for a type or mix no format serves, rows
    that are not whole blocks, parts of different K, or (Q4_0 as q4_1) a -8 d beyond fp16.
    """
    types = [t for t, _ in parts]
    fmt = gguf_format(types)
    if fmt is None:
        raise ValueError(f"no packed format serves GGUF types {tuple(types)} exactly")
    ks = {_row_weights(t, raw) for t, raw in parts}
    if len(ks) != 1:
        raise ValueError(f"parts have different input features {sorted(ks)}")
    if fmt == "f32":
        return pack_f32(torch.cat([dequantize_gguf(t, raw) for t, raw in parts]), bias)
    if native and native_problem() is None:
        size = min(BLOCK_BYTES[t][0] for t in types)
        return pack_blocks([(t, raw.contiguous()) for t, raw in parts], fmt, next(iter(ks)),
                           size, bias, allocate)
    blocks = [_blocks(t, raw) for t, raw in parts]
    if fmt == "i8_k":
        size = min(b.size for b in blocks)
        blocks = [b.with_size(size) for b in blocks]
    b = _Blocks.cat(blocks)
    if fmt in ("q4_k", "q5_k"):  # sc, m per 32: the form's per-16 values come in equal pairs
        return pack_k_blocks(fmt, b.q.to(torch.uint8), b.sc[:, ::2].to(torch.uint8),
                             b.m[:, ::2].to(torch.uint8), b.d, b.dmin, bias)
    if fmt == "q6_k":  # q - 32 in the form; no min
        return pack_q6_k_blocks((b.q + 32).to(torch.uint8), b.sc.to(torch.int8), b.d, bias)
    if fmt == "i8_k":
        return pack_k_blocks("i8_k", b.q.to(torch.int8), b.sc.to(torch.int8),
                             b.m.to(torch.int8), b.d, b.dmin, bias, super_group=b.size)
    if fmt == "q8_0":  # sc = 1, no min
        return pack_q8_0_blocks(b.q.to(torch.int8), b.d, bias, group=32)
    if fmt == "q4_0":  # the form's q - 8 back to the file's q
        return pack_q4_0_blocks((b.q + 8).to(torch.uint8), b.d, bias, group=32)
    # q4_1: Q4_0's d (q - 8) as d q + (-8 d); Q4_1's d q - (-m) 1 as d q + m
    q4_0 = torch.cat([torch.full((x.q.shape[0], 1), t == "Q4_0") for t, x in zip(types, blocks)])
    q = b.q + 8 * q4_0                                                   # [N, K] in [0, 15]
    mins = torch.where(q4_0, -8 * b.d.float(), -b.dmin.float())          # [N, K / 32]
    m16 = mins.to(torch.float16)
    if not torch.equal(m16.float(), mins):
        raise ValueError("a Q4_0 block's -8 d is beyond fp16: not servable as q4_1")
    return pack_q4_1_blocks(q.to(torch.uint8), b.d, m16, bias, group=32)


@dataclass(frozen=True)
class _Blocks:
    """Rows in the module's form: q [N, K] int16; sc, m [N, K / 16] int16; d, dmin
    [N, K / size] float16; size: weights a block (256 or 32)."""

    q: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    size: int

    def with_size(self, size: int) -> _Blocks:
        """The same weights with d, dmin repeated per block of `size` (a divisor of size)."""
        r = self.size // size
        return _Blocks(self.q, self.sc, self.m, self.d.repeat_interleave(r, dim=1),
                       self.dmin.repeat_interleave(r, dim=1), size)

    @staticmethod
    def cat(parts: list[_Blocks]) -> _Blocks:
        assert len({p.size for p in parts}) == 1, "blocks of one size only"
        return _Blocks(*(torch.cat([getattr(p, f) for p in parts])
                         for f in ("q", "sc", "m", "d", "dmin")), parts[0].size)


def _row_weights(gguf_type: str, raw: torch.Tensor) -> int:
    """K of rows of this type; raises ValueError for a bad type, dtype or row length."""
    if gguf_type not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {gguf_type!r} is not served (served: {tuple(BLOCK_BYTES)})")
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.device.type != "cpu" or \
            raw.shape[0] < 1:
        raise ValueError(f"raw rows must be a [N, row_bytes] uint8 CPU tensor, got {raw.dtype} "
                         f"{tuple(raw.shape)} on {raw.device}")
    size, nbytes = BLOCK_BYTES[gguf_type]
    if raw.shape[1] == 0 or raw.shape[1] % nbytes:
        raise ValueError(f"{gguf_type} rows are whole blocks of {nbytes} bytes, got "
                         f"{raw.shape[1]} bytes a row")
    return raw.shape[1] // nbytes * size


def _bits(a: np.ndarray, shifts: Sequence[int], width: int) -> np.ndarray:
    """a [..., n] uint8 -> [..., len(shifts), n]: field of `width` bits at each shift."""
    s = np.asarray(shifts, dtype=np.uint8).reshape(-1, 1)
    return (a[..., None, :] >> s) & np.uint8((1 << width) - 1)


def _half(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float16 (little-endian)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 mins (ggml's get_scale_min_k4):
    bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7; bytes 4-7
    the same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins
    4-7 (high nibble)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _blocks(gguf_type: str, raw: torch.Tensor) -> _Blocks:
    """Decode rows of a block type into the module's form."""
    n = raw.shape[0]
    size, nbytes = BLOCK_BYTES[gguf_type]
    r = raw.numpy().reshape(-1, nbytes)                                  # [B, bytes]
    nb = r.shape[0]
    one = np.ones((nb, size // 16), np.int16)
    zero16 = np.zeros(nb, np.float16)
    if gguf_type in ("Q4_K", "Q5_K"):
        d, dmin = _half(r[:, 0:2]), _half(r[:, 2:4])
        sc, m = _k_scales(r[:, 4:16])
        ql = r[:, -128:].reshape(nb, 4, 32)                              # chunk j: 64 weights
        q = _bits(ql, (0, 4), 4).reshape(nb, 256).astype(np.int16)      # 64 j + 32 h + i
        if gguf_type == "Q5_K":  # bit b of qh[i]: weight 32 b + i
            q |= _bits(r[:, 16:48], range(8), 1).reshape(nb, 256).astype(np.int16) << 4
        sc, m = np.repeat(sc, 2, axis=1), np.repeat(m, 2, axis=1)        # per 32 -> per 16
    elif gguf_type == "Q6_K":  # ql 128, qh 64, int8 scales 16, d
        ql = _bits(r[:, 0:128].reshape(nb, 2, 64), (0, 4), 4)           # 128 h + 64 t + i
        qh = _bits(r[:, 128:192].reshape(nb, 2, 32), (0, 2, 4, 6), 2)   # 128 h + 32 s + i
        q = (ql.reshape(nb, 256).astype(np.int16) | (qh.reshape(nb, 256).astype(np.int16) << 4)) - 32
        sc, m = r[:, 192:208].view(np.int8), np.zeros((nb, 16), np.int16)
        d, dmin = _half(r[:, 208:210]), zero16
    elif gguf_type == "Q2_K":  # scales 16 (sc low nibble, m high), qs 64, d, dmin
        sc, m = r[:, 0:16] & 15, r[:, 0:16] >> 4
        q = _bits(r[:, 16:80].reshape(nb, 2, 32), (0, 2, 4, 6), 2).reshape(nb, 256).astype(np.int16)
        d, dmin = _half(r[:, 80:82]), _half(r[:, 82:84])
    elif gguf_type == "Q3_K":  # hmask 32, qs 64, 12 bytes of 6-bit scales (- 32), d
        ql = _bits(r[:, 32:96].reshape(nb, 2, 32), (0, 2, 4, 6), 2).reshape(nb, 256)
        hi = _bits(r[:, 0:32], range(8), 1).reshape(nb, 256)              # bit b of hmask[i]
        q = ql.astype(np.int16) - 4 * (1 - hi.astype(np.int16))
        s = r[:, 96:108]
        low = _bits(s[:, 0:8], (0, 4), 4).reshape(nb, 16)                 # scale 8 t + i: byte i
        high = _bits(s[:, 8:12], (0, 2, 4, 6), 2).reshape(nb, 16)          # scale 4 t + i: byte 8 + i
        sc = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        m, d, dmin = np.zeros((nb, 16), np.int16), _half(r[:, 108:110]), zero16
    else:  # legacy, 32 weights: d [, m] [, qh] then 16 nibble bytes (weight i low, 16 + i high)
        d = _half(r[:, 0:2])
        dmin, m, sc = zero16, np.zeros((nb, 2), np.int16), one
        if gguf_type == "Q8_0":
            q = r[:, 2:34].view(np.int8).astype(np.int16)
        else:
            q = _bits(r[:, -16:], (0, 4), 4).reshape(nb, 32).astype(np.int16)
            if gguf_type in ("Q5_0", "Q5_1"):  # bit i of the little-endian uint32 qh
                qh_at = 2 if gguf_type == "Q5_0" else 4
                q |= _bits(r[:, qh_at:qh_at + 4], range(8), 1).transpose(0, 2, 1).reshape(
                    nb, 32).astype(np.int16) << 4
            if gguf_type in ("Q4_1", "Q5_1"):  # + m = - (-m) * 1
                dmin, m = -_half(r[:, 2:4]), one.copy()
            else:
                q -= 8 if gguf_type == "Q4_0" else 16
    k = r.shape[0] // n * size

    def t(a: np.ndarray, cols: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(n, cols)

    return _Blocks(t(q.astype(np.int16), k), t(np.asarray(sc).astype(np.int16), k // 16),
                   t(np.asarray(m).astype(np.int16), k // 16), t(d, k // size),
                   t(dmin, k // size), size)
