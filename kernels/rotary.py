"""Rotary position embedding (RoFormer, Su et al., 2021), Llama "rotate half".

The pairs are (i, i + D/2) for i < D/2, as in Hugging Face transformers'
``apply_rotary_pos_emb``: ``out = x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x[D/2:], x[:D/2])``. ``cos``/``sin`` here hold the
D/2 distinct frequencies only (HF repeats them twice along D).
"""

from __future__ import annotations

import torch

try:
    import triton.language as tl
except ImportError:  # triton is optional: the torch reference needs none of it
    tl = None  # type: ignore[assignment]

from kernels import _triton


def _check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k must be [T, Hkv, D] with T, D of q {tuple(q.shape)}, got shape {tuple(k.shape)}")
    if q.shape[2] % 2 != 0:
        raise ValueError(f"head dim must be even, q shape {tuple(q.shape)}")
    expected = (q.shape[0], q.shape[2] // 2)
    if cos.shape != expected:
        raise ValueError(f"cos must be [T, D/2] = {expected}, got shape {tuple(cos.shape)}")
    if sin.shape != expected:
        raise ValueError(f"sin must be [T, D/2] = {expected}, got shape {tuple(sin.shape)}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos.float()[:, None, :]  # [T, 1, D/2]
    s = sin.float()[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' angles (torch reference).

    Args:
        q: [T, Hq, D]; k: [T, Hkv, D]; same dtype, D even.
        cos, sin: [T, D/2], already gathered at each token's position.

    Returns:
        (q_out, k_out), new tensors of q's and k's shapes and dtype; the
        rotation is computed in fp32.

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    _check_rotary_args(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    x_tok_stride,
    x_head_stride,
    out_tok_stride,
    out_head_stride,
    cos_stride,
    sin_stride,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # grid: (T,); program t rotates all heads of token t.
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    mask = (heads[:, None] < num_heads) & dmask[None, :]
    c = tl.load(cos_ptr + tok * cos_stride + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * sin_stride + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + tok * x_tok_stride + heads[:, None] * x_head_stride + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + tok * out_tok_stride + heads[:, None] * out_head_stride + dims[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0 or num_heads == 0:
        return out
    _triton.jit(_rotary_kernel)[(tokens,)](
        x,
        out,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        HALF=head_dim // 2,
        BLOCK_H=_triton.next_power_of_2(num_heads),
        BLOCK_HALF=_triton.next_power_of_2(head_dim // 2),
    )
    return out


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in Triton (fp32 math); same contract as ``rotary_embedding_ref``.

    q and k may be strided views (e.g. slices of a fused QKV projection) as
    long as the head dim has unit stride; outputs are new contiguous tensors.

    Raises:
        ValueError: as ``rotary_embedding_ref``, plus a non-unit last stride
            in q, k, cos or sin.
    """
    _check_rotary_args(q, k, cos, sin)
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, shape {tuple(t.shape)} strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, shape {tuple(t.shape)} strides {t.stride()}")
    return _launch_rotary(q, cos, sin), _launch_rotary(k, cos, sin)
