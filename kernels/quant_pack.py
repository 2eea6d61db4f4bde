"""Weights packed for the C++ linear kernels (``kernels.quant_linear_cpu``), and their torch
references.

Three formats, each ``y = x @ W^T (+ b)`` with x and y fp32:

- ``f32``: the weight as is, in panels (for the batch-invariant fp32 path);
- ``int8``: symmetric per output channel, ``W[n, :] ~= scale[n] * q[n, :]``, q in
  [-127, 127], ``scale[n] = max|W[n, :]| / 127`` (round to nearest);
- ``int4``: asymmetric per group of ``group`` input channels (GGUF's Q4_1 layout of a
  block, Gerganov et al., ggml): ``W[n, k] ~= d[n, g] * q[n, k] + min[n, g]``, q in
  [0, 15], g = k // group; round-to-nearest over the group's range, then (d, min) refined
  by least squares (``quantize_int4``).

Layout (see ``kernels/csrc/quant_linear_cpu.cpp``): output channels padded to Np, a
multiple of 64, in blocks of 64 channels stored k-major: the kernel loads 16 channels of one
k as one vector, and one row streams through each block sequentially.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("f32", "int8", "int4")
PAD = 64
"""Output channels are padded to a multiple of this, and stored in blocks of this many."""
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A `[N, K]` weight (and bias) in one of FORMATS, packed for the C++ kernel.

    data: f32 [Np/64, K, 64] float32; int8 [Np/64, K, 64] int8; int4 [Np/64, ceil(K/2), 64]
        uint8 (low nibble k = 2j, high nibble k = 2j + 1).
    scale: int8 [Np] float32; int4 d [Np/64, ceil(K/group), 64] float32; f32 None.
    minv: int4 [Np/64, ceil(K/group), 64] float32; else None.
    bias: [Np] float32 (zeros past N) or None.
    """

    fmt: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scale: torch.Tensor | None
    minv: torch.Tensor | None
    bias: torch.Tensor | None
    group: int = 0

    @property
    def padded_out(self) -> int:
        return self.data.shape[0] * PAD

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the weight (data, scales, bias)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.data, self.scale, self.minv, self.bias) if t is not None)


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
    if k % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)                          # [N, ceil(K/2)]
    return PackedWeight("int4", n, k, _panels(nibbles, _np(n)), _panels(d, _np(n)),
                        _panels(minv, _np(n)), _padded_bias(bias, _np(n)), group)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """[N, K] float32: the weight the kernel multiplies by (the reference dequantization).

    int8: q * scale (one rounding); int4: d * q + min, rounded once (as the kernel's fma).
    """
    n, k, np_ = packed.out_features, packed.in_features, packed.padded_out
    rows = packed.data.movedim(-1, 1).reshape(np_, -1)[:n]            # [N, K or ceil(K/2)]
    if packed.fmt == "f32":
        return rows.clone()
    if packed.fmt == "int8":
        assert packed.scale is not None
        return rows.float() * packed.scale[:n, None]
    assert packed.scale is not None and packed.minv is not None
    q = torch.stack([rows & 15, rows >> 4], dim=-1).reshape(n, -1)[:, :k].double()
    g_of_k = torch.arange(k) // packed.group
    d = packed.scale.movedim(-1, 1).reshape(np_, -1)[:n, g_of_k].double()
    m = packed.minv.movedim(-1, 1).reshape(np_, -1)[:n, g_of_k].double()
    return (q * d + m).float()


def quant_linear_ref(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The torch reference of the kernel: x [M, K] float32 -> [M, N] float32, computed in
    float64 from `unpack(packed)` (so it differs from the kernel by fp32 rounding only)."""
    y = x.double() @ unpack(packed).double().t()
    if packed.bias is not None:
        y += packed.bias[:packed.out_features].double()
    return y.float()
