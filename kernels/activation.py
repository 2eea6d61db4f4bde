"""SiLU-and-mul: the gated activation of the Llama MLP (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton.language as tl
except ImportError:  # triton is optional: the torch reference needs none of it
    tl = None  # type: ignore[assignment]

from kernels import _triton


def _check_act_args(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [T, 2*I], got shape {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` (torch reference).

    Args:
        x: [T, 2*I], the fused gate/up projection output (gate first).

    Returns:
        [T, I] in x's dtype.

    Raises:
        ValueError: x is not 2-D with an even last dimension.
    """
    _check_act_args(x)
    half = x.shape[1] // 2
    return F.silu(x[:, :half]) * x[:, half:]


def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    inter,
    BLOCK: tl.constexpr,
):
    # grid: (T, cdiv(I, BLOCK)); program (t, c) computes out[t, c*BLOCK : (c+1)*BLOCK].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * out_row_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` (Triton; computed in fp32).

    Args:
        x: [T, 2*I] with unit stride along the last dimension.

    Returns:
        [T, I] in x's dtype, contiguous.

    Raises:
        ValueError: bad shape or a non-unit last stride.
    """
    _check_act_args(x)
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride in its last dimension, shape {tuple(x.shape)} strides {x.stride()}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(1024, _triton.next_power_of_2(inter))
    grid = (tokens, -(-inter // block))
    _triton.jit(_silu_and_mul_kernel)[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out
