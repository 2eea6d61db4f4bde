"""The small ops of the unfused CPU forward (prefill and mixed steps) in C++, float32.

RMSNorm, residual add + RMSNorm, rotary embedding and SiLU x mul over the rows of a step,
on the threads, with the row functions the fused decode forward uses
(``kernels/csrc/decode_forward_cpu.cpp``, the same library). As torch's eager ops they cost
about 60 ms of a 600 ms 512-token prefill step on a 2-core Zen 4 (AVX-512, 2026-12-04):
``torch.rms_norm`` alone 0.32 ms a call at [512, 576], ``F.silu`` 0.35 ms at [512, 1536],
and the rotary embedding five ops and a concatenation.

Each function takes and returns what the ``KernelOps`` field of the same name does
(``kernels.dispatch``): float32 CPU tensors whose rows have unit-stride elements. The math
is the references' (``kernels.rms_norm``, ``kernels.rotary``, ``kernels.activation``) up to
float rounding: RMSNorm's sum of squares runs in vector lanes, not in torch's order; SiLU
clamps exp's argument to [-87, 87] (``silu_mul_row``). ``rotary_qkv`` rotates q and k inside the
fused projection, in place.
"""

from __future__ import annotations

import torch

from kernels import decode_forward_cpu as dfc

__all__ = ["build_problem", "fused_add_rms_norm", "rms_norm", "rotary_qkv", "rotary_tables",
           "silu_and_mul"]


def build_problem() -> str | None:
    """Why these ops cannot run here (the library does not build or load), or None."""
    return dfc.LIBRARY.problem()


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or (
            t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        raise ValueError(f"{name} must be a float32 CPU [rows, n] tensor with unit-stride rows, "
                         f"got {t.dtype} shape {tuple(t.shape)} strides {t.stride()} on {t.device}")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: the C++ kernel rejected its arguments (code {rc})")


def _weight(w: torch.Tensor, n: int) -> None:
    if (w.dtype != torch.float32 or w.device.type != "cpu" or w.shape != (n,)
            or not w.is_contiguous()):
        raise ValueError(f"weight must be a contiguous float32 CPU [{n}] tensor, got {w.dtype} "
                         f"shape {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> RMSNorm(x) * weight [T, H], a new tensor.

    Raises:
        ValueError: a tensor that is not float32 on the CPU with unit-stride rows, a weight
            not [H].
    """
    _rows(x, "x")
    _weight(weight, x.shape[1])
    y = torch.empty(x.shape, dtype=torch.float32)
    _check(dfc.LIBRARY.load().conveyor_rms_norm_rows(
        x.data_ptr(), max(x.stride(0), x.shape[1]), weight.data_ptr(), eps, x.shape[0],
        x.shape[1], y.data_ptr(), x.shape[1], torch.get_num_threads()), "rms_norm")
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), both [T, H]; x (a fresh layer output)
    is overwritten with x + residual and returned as the new residual.

    Raises:
        ValueError: as ``rms_norm``; residual not of x's shape.
    """
    _rows(x, "x")
    _rows(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must be x's shape {tuple(x.shape)}")
    _weight(weight, x.shape[1])
    n = x.shape[1]
    y = torch.empty(x.shape, dtype=torch.float32)
    _check(dfc.LIBRARY.load().conveyor_add_rms_norm_rows(
        x.data_ptr(), max(x.stride(0), n), residual.data_ptr(), max(residual.stride(0), n),
        weight.data_ptr(), eps, x.shape[0], n, y.data_ptr(), n, torch.get_num_threads()),
        "fused_add_rms_norm")
    return y, x


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, D/2] gathered at positions [T]: [T, D/2] each, contiguous
    (what ``rotary_qkv`` takes)."""
    return cos[positions].contiguous(), sin[positions].contiguous()


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotates q and k of the fused projection qkv [T, (Hq + 2 Hkv) D] in place
    (rotate-half: x1 c - x2 s | x2 c + x1 s), cos, sin [T, D/2] from ``rotary_tables``.

    Returns:
        q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]: views of qkv.

    Raises:
        ValueError: qkv not float32 on the CPU with unit-stride rows of (Hq + 2 Hkv) D
            floats; cos or sin not contiguous float32 [T, D/2]; an odd head dim.
    """
    _rows(qkv, "qkv")
    T, D, Hq, Hkv = qkv.shape[0], head_dim, num_heads, num_kv_heads
    if qkv.shape[1] != (Hq + 2 * Hkv) * D:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, not (Hq + 2 Hkv) D = "
                         f"{(Hq + 2 * Hkv) * D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (T, D // 2) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [{T}, {D // 2}] tensor, got "
                             f"{t.dtype} shape {tuple(t.shape)}")
    _check(dfc.LIBRARY.load().conveyor_rotate_rows(
        qkv.data_ptr(), max(qkv.stride(0), qkv.shape[1]), Hq + Hkv, D, cos.data_ptr(),
        sin.data_ptr(), T, torch.get_num_threads()), "rotary_qkv")
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> silu(x[:, :I]) * x[:, I:], [T, I] (a new tensor).

    Raises:
        ValueError: x not float32 on the CPU with unit-stride rows, or an odd width.
    """
    _rows(x, "x")
    if x.shape[1] % 2:
        raise ValueError(f"x needs an even width (gate then up), got {x.shape[1]}")
    i = x.shape[1] // 2
    out = torch.empty(x.shape[0], i, dtype=torch.float32)
    if i == 0:
        return out
    _check(dfc.LIBRARY.load().conveyor_silu_mul_rows(
        x.data_ptr(), max(x.stride(0), x.shape[1]), x.shape[0], i, out.data_ptr(), i,
        torch.get_num_threads()), "silu_and_mul")
    return out
