"""RMSNorm (Zhang & Sennrich, 2019) and its fused residual-add variant.

Matches Hugging Face ``LlamaRMSNorm``: the statistic is computed in fp32, the
normalised value is cast back to the input dtype, then scaled by the weight.
"""

from __future__ import annotations

import torch

try:
    import triton.language as tl
except ImportError:  # triton is optional: the torch reference needs none of it
    tl = None  # type: ignore[assignment]

from kernels import _triton


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [H] with H = {x.shape[1]}, got shape {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` per row (torch reference).

    Args:
        x: [T, H] float tensor.
        weight: [H].
        eps: > 0, added to the mean square.

    Returns:
        [T, H] in x's dtype; the statistic is computed in fp32.

    Raises:
        ValueError: bad shapes, device mismatch or eps <= 0.
    """
    _check_norm_args(x, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual; out = rms_norm(new_residual)`` (torch reference).

    Args:
        x, residual: [T, H], same dtype.
        weight: [H].
        eps: > 0.

    Returns:
        (out, new_residual), both [T, H] in x's dtype; inputs are not modified.

    Raises:
        ValueError: bad shapes, dtypes, devices or eps <= 0.
    """
    _check_norm_args(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}) must match x ({tuple(x.shape)}, {x.dtype})"
        )
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


_MAX_HIDDEN = 65536  # one program holds a whole row


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    new_residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (T,); one program normalises one row of H values.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first, as the torch reference does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_row_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens, hidden = x.shape
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"x hidden size {hidden} exceeds {_MAX_HIDDEN} (x shape {tuple(x.shape)})")
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, shape {tuple(t.shape)} strides {t.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, shape {tuple(weight.shape)} strides {weight.stride()}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(out) if residual is not None else None
    if tokens == 0:
        return out, new_residual
    res = residual if residual is not None else x
    new_res = new_residual if new_residual is not None else out
    _triton.jit(_rms_norm_kernel)[(tokens,)](
        x,
        res,
        weight,
        out,
        new_res,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        new_res.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=_triton.next_power_of_2(hidden),
    )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in Triton; same contract as ``rms_norm_ref``.

    Raises:
        ValueError: as ``rms_norm_ref``, plus a non-unit last stride or
            H > 65536.
    """
    _check_norm_args(x, weight, eps)
    out, _ = _launch_norm(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one Triton launch; same contract as ``fused_add_rms_norm_ref``.

    Raises:
        ValueError: as ``fused_add_rms_norm_ref``, plus a non-unit last
            stride or H > 65536.
    """
    _check_norm_args(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) must match "
            f"x ({tuple(x.shape)}, {x.dtype}, {x.device})"
        )
    out, new_residual = _launch_norm(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
