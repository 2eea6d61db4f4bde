"""Weights packed for the C++ linear kernels (``kernels.quant_linear_cpu``), and their torch
references.

Fourteen formats, each ``y = x @ W^T (+ b)`` with x and y fp32:

- ``f32``: the weight as is, in panels (for the batch-invariant fp32 path);
- ``int8``: symmetric per output channel, ``W[n, :] ~= scale[n] * q[n, :]``, q in
  [-127, 127], ``scale[n] = max|W[n, :]| / 127`` (round to nearest);
- ``int4``: asymmetric per group of ``group`` input channels (GGUF's Q4_1 layout of a
  block, Gerganov et al., ggml): ``W[n, k] ~= d[n, g] * q[n, k] + min[n, g]``, q in
  [0, 15], g = k // group; round-to-nearest over the group's range, then (d, min) refined
  by least squares (``quantize_int4``);
- ``q4_1``: int4's form with d and min in fp16, GGUF's Q4_1 block at group 32 (5.0 bits a
  weight);
- ``q4_0``: q4_1 without its mins (``minv`` None): GGUF's Q4_0 block, ``d (q - 8)``, whose
  min -8 d the kernel forms itself, exactly (4.5 bits a weight, the file's);
- ``q8_0``: ``W[n, k] = d[n, g] * q[n, k]``, q int8 in [-127, 127], d fp16 per group of
  ``group`` input channels: GGUF's Q8_0 block at group 32 (8.5 bits a weight).
- ``q4_1x8``, ``q4_0x8``, ``q8_0x8``: q4_1's, q4_0's and q8_0's weights, with x quantized to
  int8 per row and group (``quantize_activations``) and multiplied in integers (llama.cpp's
  AVX2 dot products over Q8 activation blocks): not the fp32 product of the weights, but
  within int8 rounding of it;
- ``q4_1x16``, ``q4_0x16``, ``q8_0x16``: the same with x quantized to int16 per row and group
  (rounding of at most 2^-16 of the group's largest |x|) and multiplied with ``vpmaddwd``: twice
  fp32's multiply-adds an instruction, for compute-bound (many-row) calls.
- ``q4_k``: GGUF's Q4_K blocks (ggml's ``block_q4_K``): per super-block of 256 input
  channels fp16 d and dmin, per group of 32 a 6-bit scale sc and min m, 4-bit q:
  ``W = (d sc) q - (dmin m)`` (d sc and dmin m exact in fp32: the kernel forms them per
  group). 4.625 bits a weight (the file: 4.5);
- ``i8_k``: any mix of GGUF's K-quant and legacy blocks in 8 bits: int8 q, per group of 16
  an int8 sc and m, per super-block of ``super_group`` (256, or 32 when a legacy type is in
  the mix) fp16 d and dmin: the same ``W = (d sc) q - (dmin m)`` (9.125 bits a weight at
  256). ``kernels.gguf_pack`` packs both from a file's bytes.
- ``q6_k``: GGUF's Q6_K blocks (ggml's ``block_q6_K``): per super-block of 256 an fp16 d,
  per group of 16 an int8 sc, 6-bit q: ``W = (d sc) (q - 32)`` (exact in fp32: 11 + 7 + 5
  significant bits at most). Stored as the file's bits regrouped (nibble lines and a
  high-bit line per 4 input channels, ``pack_q6_k_blocks``): 6.5625 bits a weight, as the
  file; layers that are all Q6_K (mixes stay i8_k);
- ``q5_k``: GGUF's Q5_K blocks (ggml's ``block_q5_K``): q4_k's scales and mins, 5-bit q in
  [0, 31] stored per 8 input channels as four nibble lines and a line of high bits
  (``_q5_lines``): 5.625 bits a weight (the file: 5.5);
- ``q4_kx16``, ``i8_kx16``, ``q6_kx16``, ``q5_kx16``: q4_k's, i8_k's, q6_k's and q5_k's weights times x quantized
  to int16 per row and group of 32 (``ACT16_K_GROUP``; two groups of 16 in one share its
  scale), as
  ``q4_1x16``: each weight group's exact integer sum, then its float steps with the group's
  ``d * sc`` and ``-(dmin * m)`` (``kernels/csrc/quant_linear_cpu.cpp``).

q4_1 / q8_0 weights come from a GGUF file's own blocks (``pack_q4_1_blocks``,
``pack_q8_0_blocks``: the served weight is the file's, bit for bit) or from fp32 by round to
nearest (``pack_q4_1``, ``pack_q8_0``: tests and benchmarks).

Layout (see ``kernels/csrc/quant_linear_cpu.cpp``): output channels padded to Np, a
multiple of 64, in blocks of 64 channels stored k-major: the kernel loads 16 channels of one
k as one vector, and one row streams through each block sequentially.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FORMATS = ("f32", "int8", "int4", "q4_1", "q8_0", "q4_1x8", "q8_0x8", "q4_1x16", "q8_0x16")
"""The formats packed from fp32 weights (and from GGUF blocks: q4_1, q8_0)."""
K_FORMATS = ("q4_k", "i8_k", "q5_k")
"""The formats with super-block scales (``super_scale``, ``super_min``), from GGUF blocks only."""
HALF_SCALE_FORMATS = ("q4_1", "q8_0", "q4_1x8", "q8_0x8", "q4_1x16", "q8_0x16", "q4_0",
                      "q4_0x8", "q4_0x16")
"""Formats whose scale (and min) tensors are float16."""
ACT8_FORMATS = {"q4_1x8": "q4_1", "q8_0x8": "q8_0", "q4_0x8": "q4_0"}
"""Formats that quantize the activations to int8 per row and weight group (as llama.cpp's
Q8 activation blocks), over the weights of the format named: the same packed tensors
(``with_int8_activations``). See ``quantize_activations``."""
ACT16_FORMATS = {"q4_1x16": "q4_1", "q8_0x16": "q8_0", "q4_0x16": "q4_0"}
"""The same with int16 activations (``with_int16_activations``; ``quantize_activations``
with ``levels=32767``)."""
K_ACT16_FORMATS = {"q4_kx16": "q4_k", "i8_kx16": "i8_k", "q6_kx16": "q6_k", "q5_kx16": "q5_k"}
"""int16 activations over the K-quant weights (``with_int16_activations``), per row and group
of ACT16_K_GROUP input channels whatever the weight's group."""
ACT16_K_GROUP = 32
"""The activation group of ``K_ACT16_FORMATS``: q4_k's weight group, two of i8_k's."""
ACT_LEVELS = {**{f: 127 for f in ACT8_FORMATS},
              **{f: 32767 for f in {**ACT16_FORMATS, **K_ACT16_FORMATS}}}
"""The largest |q| of each activation-quantizing format's x."""
ACT16_MAX_GROUP = 256
"""int16 activations keep a group's integer sum in int32: at most 256 products of 127 * 32767."""
PAD = 64
"""Output channels are padded to a multiple of this, and stored in blocks of this many."""
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A `[N, K]` weight (and bias) in one of FORMATS, packed for the C++ kernel.

    data: f32 [Np/64, K, 64] float32; int8 [Np/64, K, 64] int8; int4 [Np/64, ceil(K/2), 64]
        uint8 (low nibble k = 2j, high nibble k = 2j + 1).
    scale: int8 [Np] float32; int4 d [Np/64, ceil(K/group), 64] float32; q4_1, q8_0 d
        [Np/64, ceil(K/group), 64] float16; f32 None.
    minv: int4 [Np/64, ceil(K/group), 64] float32; q4_1 the same in float16; else None.
    group: input channels per scale (int4, q4_1, q8_0, q4_k, q5_k: 32, i8_k: 16); 0 otherwise.
    (q4_1 and q4_k data is laid out as int4's, q8_0 and i8_k data as int8's; q5_k data is
    [Np/64, 5K/8, 64] uint8, ``_q5_lines``.)
    bias: [Np] float32 (zeros past N) or None.
    K_FORMATS only: scale, minv are the groups' sc and m, [Np/64, K/group, 64] (q4_k, q5_k uint8
    in [0, 63], i8_k int8); super_scale, super_min: d and dmin [Np/64, K/super_group, 64]
    float16; super_group: input channels per d (q4_k, q5_k 256; i8_k 256 or 32). The weight is
    ``(d * sc) * q - dmin * m`` in fp32 (``unpack``).
    q6_k: data [Np/64, 3K/4, 64] uint8 (per 4 input channels two nibble lines and a
    high-bit line, ``pack_q6_k_blocks``); scale sc [Np/64, K/16, 64] int8; super_scale d
    [Np/64, K/256, 64] float16; minv, super_min None; group 16, super_group 256. The weight
    is ``(d * sc) * (q - 32)``, exact in fp32.
    """

    fmt: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scale: torch.Tensor | None
    minv: torch.Tensor | None
    bias: torch.Tensor | None
    group: int = 0
    super_scale: torch.Tensor | None = None
    super_min: torch.Tensor | None = None
    super_group: int = 0

    @property
    def padded_out(self) -> int:
        return self.data.shape[0] * PAD

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the weight (data, scales, bias)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.data, self.scale, self.minv, self.bias, self.super_scale,
                             self.super_min) if t is not None)


def _check(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
        raise ValueError(f"weight must be a 2-D float [out, in] CPU tensor, got {weight.dtype} "
                         f"shape {tuple(weight.shape)} on {weight.device}")
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"weight must have at least one row and column, got {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be float [out] = [{weight.shape[0]}], got {bias.dtype} "
                         f"shape {tuple(bias.shape)}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} has non-finite entries")
    return w


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if rows > t.shape[0] else t


def _panels(t: torch.Tensor, np_: int) -> torch.Tensor:
    """[N, K...] -> [Np/64, K..., 64]: channels 64b..64b+63 of block b moved innermost."""
    t = _pad_rows(t, np_)
    t = t.view(np_ // PAD, PAD, *t.shape[1:])
    return t.movedim(1, -1).contiguous()


def _padded_bias(bias: torch.Tensor | None, np_: int) -> torch.Tensor | None:
    return None if bias is None else _pad_rows(bias.detach().float(), np_).contiguous()


def _np(n: int) -> int:
    return -(-n // PAD) * PAD


def pack_f32(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack an fp32 `[N, K]` weight unchanged. Raises ValueError (shape, dtype, non-finite)."""
    w = _check(weight, bias)
    n, k = w.shape
    return PackedWeight("f32", n, k, _panels(w, _np(n)), None, None, _padded_bias(bias, _np(n)))


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Symmetric per-channel int8 (module docstring). Raises ValueError as pack_f32."""
    w = _check(weight, bias)
    n, k = w.shape
    amax = w.abs().amax(dim=1)                                        # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("int8", n, k, _panels(q, _np(n)), _pad_rows(scale, _np(n)).contiguous(),
                        None, _padded_bias(bias, _np(n)))


INT4_REFINE_STEPS = 2


def quantize_int4(weight: torch.Tensor, group: int,
                  refine_steps: int = INT4_REFINE_STEPS) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """Asymmetric int4 per group of `group` input channels.

    Starts from round-to-nearest over the group's [min, max] and refines (d, min) by
    alternating least squares, as llama.cpp's k-quants do (``make_qkx2_quants``): fit
    ``w ~= d q + min`` to the current q by least squares, re-round q, keep the better; the
    squared error never grows. A group already on a 4-bit grid (a GGUF Q4_1 block) stays
    exact.

    Returns (q [N, K] uint8 in [0, 15], d [N, G] float32, minv [N, G] float32), G = ceil(K /
    group), with ``weight[n, k] ~= d[n, k // group] * q[n, k] + minv[n, k // group]``. A
    constant group gets d = 1 (q = 0, exact).
    """
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}")
    w = _check(weight, None)
    n, k = w.shape
    groups = -(-k // group)
    pad = groups * group - k
    wg = torch.nn.functional.pad(w, (0, pad)).view(n, groups, group)
    valid = (torch.arange(groups * group) < k).view(1, groups, group).expand_as(wg)
    lo = torch.where(valid, wg, torch.inf).amin(-1)                   # [N, G]
    hi = torch.where(valid, wg, -torch.inf).amax(-1)
    d = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
    m = lo

    def assign(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round((wg - m[..., None]) / d[..., None]).clamp_(0, 15)
        err = torch.where(valid, (q * d[..., None] + m[..., None] - wg) ** 2, 0).sum(-1)
        return q, err

    q, err = assign(d, m)
    cnt = valid.sum(-1).float()
    for _ in range(refine_steps):
        qv = torch.where(valid, q, 0)
        sq, sqq = qv.sum(-1), (qv * qv).sum(-1)
        sw, sqw = torch.where(valid, wg, 0).sum(-1), (qv * wg).sum(-1)
        det = cnt * sqq - sq * sq
        ok = det > 0
        d_new = torch.where(ok, (cnt * sqw - sq * sw) / torch.where(ok, det, 1), d)
        ok &= d_new > 0
        d_new = torch.where(ok, d_new, d)
        m_new = torch.where(ok, (sw - d_new * sq) / cnt, m)
        q_new, err_new = assign(d_new, m_new)
        better = err_new < err
        d, m = torch.where(better, d_new, d), torch.where(better, m_new, m)
        q, err = torch.where(better[..., None], q_new, q), torch.minimum(err, err_new)
    q = q.reshape(n, groups * group)[:, :k].to(torch.uint8)
    return q, d.float(), m.float()


def pack_int4(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              group: int = 64) -> PackedWeight:
    """Group-wise asymmetric int4 (module docstring, `quantize_int4`). Raises ValueError for a
    group size outside INT4_GROUP_SIZES and as pack_f32."""
    _check(weight, bias)
    q, d, minv = quantize_int4(weight, group)
    n, k = q.shape
    return PackedWeight("int4", n, k, _panels(_nibbles(q), _np(n)), _panels(d, _np(n)),
                        _panels(minv, _np(n)), _padded_bias(bias, _np(n)), group)


def _half_scales(d: torch.Tensor, what: str) -> torch.Tensor:
    d16 = d.to(torch.float16)
    if not bool(torch.isfinite(d16).all()):
        raise ValueError(f"{what} out of the fp16 range")
    return d16


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 in [0, 15] -> [N, ceil(K/2)]: low nibble k = 2j, high nibble k = 2j + 1."""
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _check_blocks(q: torch.Tensor, d: torch.Tensor, group: int, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> None:
    if q.dim() != 2 or q.dtype != dtype or q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"q must be a 2-D {dtype} [N, K] tensor, got {q.dtype} shape "
                         f"{tuple(q.shape)}")
    if group < 1 or d.dtype != torch.float16 or d.shape != (q.shape[0], -(-q.shape[1] // group)):
        raise ValueError(f"d must be float16 [N, ceil(K / group)] = [{q.shape[0]}, "
                         f"{-(-q.shape[1] // max(group, 1))}], got {d.dtype} shape "
                         f"{tuple(d.shape)} (group {group})")
    if bias is not None and (bias.shape != (q.shape[0],) or not bias.is_floating_point()):
        raise ValueError(f"bias must be float [out] = [{q.shape[0]}], got {bias.dtype} "
                         f"shape {tuple(bias.shape)}")


def pack_q4_1_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None, *, group: int = 32) -> PackedWeight:
    """Pack 4-bit values with their fp16 scales and mins as they are (a GGUF Q4_1 tensor's
    blocks; a Q4_0 one with m = -8 d): ``W[n, k] = d[n, g] * q[n, k] + m[n, g]``.

    q: [N, K] uint8 in [0, 15]; d, m: [N, ceil(K / group)] float16; group even.
    Raises ValueError for other shapes or dtypes, an odd group or q above 15."""
    _check_blocks(q, d, group, bias, torch.uint8)
    if m.shape != d.shape or m.dtype != torch.float16 or group % 2:
        raise ValueError(f"m must be float16 like d {tuple(d.shape)} and the group even, got "
                         f"{m.dtype} {tuple(m.shape)}, group {group}")
    if int(q.max()) > 15:
        raise ValueError("q4_1 values must be in [0, 15]")
    n, k = q.shape
    return PackedWeight("q4_1", n, k, _panels(_nibbles(q), _np(n)), _panels(d, _np(n)),
                        _panels(m, _np(n)), _padded_bias(bias, _np(n)), group)


def pack_q4_0_blocks(q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None, *,
                     group: int = 32) -> PackedWeight:
    """Pack a GGUF Q4_0 tensor's blocks as they are: ``W[n, k] = d[n, g] * (q[n, k] - 8)``,
    the kernel forming the min -8 d itself (exact). q: [N, K] uint8 in [0, 15]; d:
    [N, ceil(K / group)] float16; group even. Raises ValueError for other shapes or dtypes,
    an odd group or q above 15."""
    _check_blocks(q, d, group, bias, torch.uint8)
    if group % 2 or int(q.max()) > 15:
        raise ValueError(f"q4_0 needs an even group and values in [0, 15], got group {group}")
    n, k = q.shape
    return PackedWeight("q4_0", n, k, _panels(_nibbles(q), _np(n)), _panels(d, _np(n)), None,
                        _padded_bias(bias, _np(n)), group)


def pack_q8_0_blocks(q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None, *,
                     group: int = 32) -> PackedWeight:
    """Pack int8 values with their fp16 scales as they are (a GGUF Q8_0 tensor's blocks):
    ``W[n, k] = d[n, g] * q[n, k]``. q: [N, K] int8; d: [N, ceil(K / group)] float16.
    Raises ValueError for other shapes or dtypes."""
    _check_blocks(q, d, group, bias, torch.int8)
    n, k = q.shape
    return PackedWeight("q8_0", n, k, _panels(q, _np(n)), _panels(d, _np(n)), None,
                        _padded_bias(bias, _np(n)), group)


def pack_q4_1(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              group: int = 32) -> PackedWeight:
    """fp32 -> q4_1 (``quantize_int4``'s d and min rounded to fp16, q re-rounded to them).
    Raises ValueError as pack_int4, or for scales out of the fp16 range."""
    w = _check(weight, bias)
    _, d, m = quantize_int4(w, group)
    d16, m16 = _half_scales(d, "int4 scales"), _half_scales(m, "int4 mins")
    d16 = torch.where(d16 == 0, torch.ones_like(d16), d16)  # a scale below fp16's range
    n, k = w.shape
    g_of_k = torch.arange(k) // group
    q = torch.round((w - m16.float()[:, g_of_k]) / d16.float()[:, g_of_k]).clamp_(0, 15)
    return pack_q4_1_blocks(q.to(torch.uint8), d16, m16, bias, group=group)


def pack_q8_0(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              group: int = 32) -> PackedWeight:
    """fp32 -> q8_0: d = max |w| / 127 per group (fp16), q = round(w / d).
    Raises ValueError as pack_f32, or for scales out of the fp16 range."""
    w = _check(weight, bias)
    n, k = w.shape
    groups = -(-k // group)
    amax = torch.nn.functional.pad(w.abs(), (0, groups * group - k)).view(n, groups, group).amax(-1)
    d16 = _half_scales(amax / 127.0, "q8_0 scales")
    d16 = torch.where(d16 == 0, torch.ones_like(d16), d16)
    g_of_k = torch.arange(k) // group
    q = torch.round(w / d16.float()[:, g_of_k]).clamp_(-127, 127).to(torch.int8)
    return pack_q8_0_blocks(q, d16, bias, group=group)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """[N, K] float32: the weight the kernel multiplies by (the reference dequantization).

    int8: q * scale (one rounding); int4, q4_1: d * q + min, rounded once (as the kernel's
    fma); q8_0: d * q (exact).
    """
    base = _ACT_BASE.get(packed.fmt)
    if base is not None:  # the same weights
        packed = dataclasses.replace(packed, fmt=base)
    n, k, np_ = packed.out_features, packed.in_features, packed.padded_out
    rows = packed.data.movedim(-1, 1).reshape(np_, -1)[:n]            # [N, K or ceil(K/2)]
    if packed.fmt in K_FORMATS:
        return _unpack_k(packed, rows)
    if packed.fmt == "q6_k":
        return _unpack_q6_k(packed, rows)
    if packed.fmt == "f32":
        return rows.clone()
    if packed.fmt == "int8":
        assert packed.scale is not None
        return rows.float() * packed.scale[:n, None]
    assert packed.scale is not None
    g_of_k = torch.arange(k) // packed.group
    d = packed.scale.movedim(-1, 1).reshape(np_, -1)[:n, g_of_k].double()
    if packed.fmt == "q8_0":
        return (rows.double() * d).float()
    assert packed.minv is not None or packed.fmt == "q4_0"
    q = torch.stack([rows & 15, rows >> 4], dim=-1).reshape(n, -1)[:, :k].double()
    if packed.fmt == "q4_0":  # min = -8 d
        return (q * d - 8 * d).float()
    m = packed.minv.movedim(-1, 1).reshape(np_, -1)[:n, g_of_k].double()
    return (q * d + m).float()


def _unpack_k(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """q4_k, q5_k, i8_k: ``(d * sc) * q - dmin * m`` in fp32, as ggml's reference (and gguf-py)
    compute it: d * sc, dmin * m and (d * sc) * q are exact, the subtraction rounds once."""
    n, k, np_ = packed.out_features, packed.in_features, packed.padded_out
    assert packed.scale is not None and packed.minv is not None
    assert packed.super_scale is not None and packed.super_min is not None
    if packed.fmt == "q4_k":
        q = torch.stack([rows & 15, rows >> 4], dim=-1).reshape(n, -1)[:, :k]
    elif packed.fmt == "q5_k":
        lines = rows.reshape(n, k // 8, 5)
        nib = torch.stack([lines[..., :4] & 15, lines[..., :4] >> 4], dim=-1).reshape(n, k // 8, 8)
        high = (lines[..., 4:5] >> torch.arange(8, dtype=torch.uint8)) & 1
        q = (nib | (high << 4)).reshape(n, k)
    else:
        q = rows
    g_of_k = torch.arange(k) // packed.group
    s_of_k = torch.arange(k) // packed.super_group

    def per_k(t: torch.Tensor, of_k: torch.Tensor) -> torch.Tensor:
        return t.movedim(-1, 1).reshape(np_, -1)[:n, of_k].float()

    d1 = per_k(packed.super_scale, s_of_k) * per_k(packed.scale, g_of_k)
    dm = per_k(packed.super_min, s_of_k) * per_k(packed.minv, g_of_k)
    return d1 * q.float() - dm


def _q5_lines(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 in [0, 31] (K a multiple of 8) -> [N, 5 K / 8]: per octet j of k, the
    nibbles of k = 8j + 2i, 8j + 2i + 1 (low, high) for i < 4, then the eight high bits (bit
    i: k = 8j + i)."""
    n, k = q.shape
    octet = q.view(n, k // 8, 8)
    low = octet & 15
    nibbles = low[..., 0::2] | (low[..., 1::2] << 4)                     # [N, K / 8, 4]
    high = ((octet >> 4) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([nibbles, high[..., None]], dim=-1).reshape(n, -1)


def _q6_lines(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 in [0, 63] (K a multiple of 4) -> [N, 3 K / 4]: per quad j of k, the
    nibbles of k = 4j, 4j + 1 (low, high), of 4j + 2, 4j + 3, then the four high 2-bit
    fields (bits 2i, 2i + 1: k = 4j + i)."""
    n, k = q.shape
    quad = q.view(n, k // 4, 4)
    low, high = quad & 15, quad >> 4
    lines = torch.stack([low[..., 0] | (low[..., 1] << 4), low[..., 2] | (low[..., 3] << 4),
                         high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4)
                         | (high[..., 3] << 6)], dim=-1)
    return lines.reshape(n, -1)


def _unpack_q6_k(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """q6_k: ``(d * sc) * (q - 32)`` in fp32, exact (gguf-py's value)."""
    n, k, np_ = packed.out_features, packed.in_features, packed.padded_out
    assert packed.scale is not None and packed.super_scale is not None
    lines = rows.reshape(n, k // 4, 3)
    high = lines[..., 2]
    q = torch.stack([(lines[..., 0] & 15) | ((high & 3) << 4),
                     (lines[..., 0] >> 4) | (((high >> 2) & 3) << 4),
                     (lines[..., 1] & 15) | (((high >> 4) & 3) << 4),
                     (lines[..., 1] >> 4) | ((high >> 6) << 4)], dim=-1).reshape(n, k)

    def per_k(t: torch.Tensor, size: int) -> torch.Tensor:
        return t.movedim(-1, 1).reshape(np_, -1)[:n, torch.arange(k) // size].float()

    d1 = per_k(packed.super_scale, packed.super_group) * per_k(packed.scale, packed.group)
    return d1 * (q.float() - 32)


def pack_q6_k_blocks(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
                     bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack Q6_K blocks as they are: ``W[n, k] = (d[n, k // 256] * sc[n, k // 16]) *
    (q[n, k] - 32)``. q: [N, K] uint8 in [0, 63], K a multiple of 256; sc: [N, K / 16] int8;
    d: [N, K / 256] float16, finite. Raises ValueError for other shapes, dtypes or values."""
    if q.dim() != 2 or q.dtype != torch.uint8 or q.shape[0] < 1 or q.shape[1] < 1 or \
            q.shape[1] % 256:
        raise ValueError(f"q6_k: q must be uint8 [N, K] with K a multiple of 256, got "
                         f"{q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    for name, t, shape, dt in (("sc", sc, (n, k // 16), torch.int8),
                               ("d", d, (n, k // 256), torch.float16)):
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"q6_k: {name} must be {dt} {shape}, got {t.dtype} {tuple(t.shape)}")
    if not bool(torch.isfinite(d).all()):
        raise ValueError("q6_k: d must be finite")
    if int(q.max()) > 63:
        raise ValueError("q6_k: q must be in [0, 63]")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be float [out] = [{n}], got {bias.dtype} {tuple(bias.shape)}")
    np_ = _np(n)
    return PackedWeight("q6_k", n, k, _panels(_q6_lines(q), np_), _panels(sc, np_), None,
                        _padded_bias(bias, np_), 16, _panels(d, np_), None, 256)


def pack_k_blocks(fmt: str, q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                  d: torch.Tensor, dmin: torch.Tensor, bias: torch.Tensor | None = None, *,
                  super_group: int = 256) -> PackedWeight:
    """Pack K-quant blocks as they are: ``W[n, k] = (d[n, s] * sc[n, g]) * q[n, k] -
    dmin[n, s] * m[n, g]`` with g = k // group, s = k // super_group.

    fmt "q4_k": q [N, K] uint8 in [0, 15]; sc, m [N, K / 32] uint8 in [0, 63]; group 32,
    super_group 256. fmt "q5_k": the same with q in [0, 31]. fmt "i8_k": q [N, K] int8; sc, m [N, K / 16] int8; group 16,
    super_group 256 or 32. d, dmin: [N, K / super_group] float16, finite. K a multiple of
    super_group. Raises ValueError for other shapes, dtypes or values."""
    if fmt not in K_FORMATS:
        raise ValueError(f"fmt must be one of {K_FORMATS}, got {fmt!r}")
    group, dtype = (16, torch.int8) if fmt == "i8_k" else (32, torch.uint8)
    if super_group not in ((256, 32) if fmt == "i8_k" else (256,)):
        raise ValueError(f"{fmt}: super_group {super_group} not supported")
    if q.dim() != 2 or q.dtype != dtype or q.shape[0] < 1 or q.shape[1] < 1 or \
            q.shape[1] % super_group:
        raise ValueError(f"{fmt}: q must be {dtype} [N, K] with K a multiple of {super_group}, "
                         f"got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    for name, t, shape, dt in (("sc", sc, (n, k // group), dtype), ("m", m, (n, k // group), dtype),
                               ("d", d, (n, k // super_group), torch.float16),
                               ("dmin", dmin, (n, k // super_group), torch.float16)):
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"{fmt}: {name} must be {dt} {shape}, got {t.dtype} {tuple(t.shape)}")
    if not bool(torch.isfinite(d).all() and torch.isfinite(dmin).all()):
        raise ValueError(f"{fmt}: d and dmin must be finite")
    top = {"q4_k": 15, "q5_k": 31}.get(fmt)
    if top is not None and (int(q.max()) > top or int(sc.max()) > 63 or int(m.max()) > 63):
        raise ValueError(f"{fmt}: q must be in [0, {top}], sc and m in [0, 63]")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be float [out] = [{n}], got {bias.dtype} {tuple(bias.shape)}")
    np_ = _np(n)
    data = _panels(_nibbles(q) if fmt == "q4_k" else _q5_lines(q) if fmt == "q5_k" else q, np_)
    return PackedWeight(fmt, n, k, data, _panels(sc, np_), _panels(m, np_),
                        _padded_bias(bias, np_), group, _panels(d, np_), _panels(dmin, np_),
                        super_group)


def with_int8_activations(packed: PackedWeight) -> PackedWeight:
    """The q4_1 / q8_0 weight `packed` as ``q4_1x8`` / ``q8_0x8`` (int8 activations), sharing
    its tensors. Raises ValueError for another format, or K not a multiple of the group."""
    return _with_activations(packed, ACT8_FORMATS, "int8")


def with_int16_activations(packed: PackedWeight) -> PackedWeight:
    """The q4_1 / q8_0 / q4_k / i8_k / q6_k weight `packed` as ``q4_1x16`` / ``q8_0x16`` /
    ``q4_kx16`` / ``i8_kx16`` / ``q6_kx16`` (int16 activations), sharing its tensors. Raises
    ValueError for another format, K not a multiple of the group, or a group above
    ACT16_MAX_GROUP."""
    if packed.fmt in K_ACT16_FORMATS.values():  # K: a multiple of super_group, so of 32
        return _with_activations(packed, K_ACT16_FORMATS, "int16")
    if packed.group > ACT16_MAX_GROUP:
        raise ValueError(f"int16 activations need a group of at most {ACT16_MAX_GROUP}, got "
                         f"{packed.group}")
    return _with_activations(packed, ACT16_FORMATS, "int16")


def _with_activations(packed: PackedWeight, formats: dict[str, str], what: str) -> PackedWeight:
    fmt = {v: k for k, v in formats.items()}.get(packed.fmt)
    if fmt is None:
        serves = ("q4_1, q4_0 and q8_0" if what == "int8"
                  else "q4_1, q4_0, q8_0, q4_k, i8_k, q6_k and q5_k")
        raise ValueError(f"{what} activations serve {serves} weights, not {packed.fmt}")
    if packed.group < 2 or packed.group % 2 or packed.in_features % packed.group:
        raise ValueError(f"{what} activations need K ({packed.in_features}) a multiple of an "
                         f"even group ({packed.group})")
    return dataclasses.replace(packed, fmt=fmt)


_ACT_BASE = {**ACT8_FORMATS, **ACT16_FORMATS, **K_ACT16_FORMATS}
"""Each activation-quantizing format's weight format (the same packed tensors)."""


def quantize_activations(x: torch.Tensor, group: int,
                         levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of `group`) -> (q [M, K] in [-levels, levels], int8 for
    127 and int16 for 32767, d [M, K / group] float32) with ``x ~= d * q`` per group: d =
    max |x| / levels over the group, q = round-half-even(x * (1 / d)), 0 for an all-zero
    group. The C++ kernel's rounding, bit for bit (fp32 throughout). Raises ValueError for
    another `levels`."""
    if levels not in (127, 32767):
        raise ValueError(f"levels must be 127 (int8) or 32767 (int16), got {levels}")
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    amax = xg.abs().amax(-1)
    d = amax / float(levels)
    inv = torch.where(amax > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xg * inv[..., None]).clamp_(-levels, levels)
    return q.to(torch.int8 if levels == 127 else torch.int16).reshape(m, k), d


def quant_linear_ref(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The torch reference of the kernel: x [M, K] float32 -> [M, N] float32, computed in
    float64 from `unpack(packed)` (so it differs from the kernel by fp32 rounding only).
    For the int8- and int16-activation formats the product is the kernel's: the weight's
    d * q times the quantized activations, plus (q4_1x8, q4_1x16) each group's min times the
    sum of x itself."""
    if packed.fmt in ACT_LEVELS:
        return _act_ref(x, packed)
    y = x.double() @ unpack(packed).double().t()
    if packed.bias is not None:
        y += packed.bias[:packed.out_features].double()
    return y.float()


def _act_ref(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    n, k = packed.out_features, packed.in_features
    g = ACT16_K_GROUP if packed.fmt in K_ACT16_FORMATS else packed.group
    q, d = quantize_activations(x, g, ACT_LEVELS[packed.fmt])
    xq = (q.double().reshape(-1, k // g, g) * d.double()[..., None]).reshape(-1, k)
    base = dataclasses.replace(packed, fmt=_ACT_BASE[packed.fmt])
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    if base.fmt in K_FORMATS:  # W = (d sc) q - dmin m: the min term over x itself
        y += x.double() @ unpack(dataclasses.replace(base, data=torch.zeros_like(base.data))
                                 ).double().t()             # q = 0: -(dmin m), exact
        base = dataclasses.replace(base, minv=torch.zeros_like(base.minv))  # (d sc) q: exact
    elif base.minv is not None or base.fmt == "q4_0":  # W = d q + min: the min over x itself
        g_of_k = torch.arange(k) // g
        mins = (-8 * base.scale.double() if base.minv is None else base.minv.double()
                ).movedim(-1, 1).reshape(base.padded_out, -1)[:n, g_of_k]
        if base.minv is None:  # q4_0: d q as q4_1's with zero mins
            base = dataclasses.replace(base, fmt="q4_1", minv=base.scale)
        y += x.double() @ mins.t()
        base = dataclasses.replace(base, minv=torch.zeros_like(base.minv))  # d q: exact
    y += xq @ unpack(base).double().t()
    if packed.bias is not None:
        y += packed.bias[:n].double()
    return y.float()
