"""Write this step's K/V into the paged cache by slot mapping.

``slot = block_id * block_size + offset``; a slot of -1 skips the token (e.g.
a prefix-cache hit whose K/V is already there, or a padding row).
"""

from __future__ import annotations

import torch

try:
    import triton.language as tl
except ImportError:  # triton is optional: the torch reference needs none of it
    tl = None  # type: ignore[assignment]

from kernels import _triton


def _check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3:
        raise ValueError(f"k must be [T, Hkv, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}] to match k, "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    if not k_cache.is_contiguous():
        raise ValueError(f"k_cache must be contiguous (shape {tuple(k_cache.shape)}, strides {k_cache.stride()})")
    if not v_cache.is_contiguous():
        raise ValueError(f"v_cache must be contiguous (shape {tuple(v_cache.shape)}, strides {v_cache.stride()})")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be [T] with T = {k.shape[0]} (k rows), got shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if v.dtype != k.dtype or v_cache.dtype != k_cache.dtype or not k_cache.dtype.is_floating_point:
        raise ValueError(
            f"k/v dtypes {k.dtype}/{v.dtype} and cache dtypes {k_cache.dtype}/{v_cache.dtype} "
            "must match in pairs (floating point caches)"
        )
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k[t], v[t] into cache slot slot_mapping[t] (torch reference).

    Args:
        k, v: [T, Hkv, D].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, one floating
            dtype (k/v's, or another: a 16-bit cache under fp32 activations, each value
            rounded to nearest even); written in place.
        slot_mapping: [T] int64, block_id * block_size + offset, or -1 to skip.

    Raises:
        ValueError: shape, dtype, device or contiguity mismatch.
        IndexError: a slot >= num_blocks * block_size.
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T,); program t copies k[t], v[t] ([Hkv, D]) into cache slot slot_mapping[t].
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
        # The cache is contiguous: a slot is num_kv_heads * HEAD_DIM elements.
        dst = slot * num_kv_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + tok * k_tok_stride + heads[:, None] * k_head_stride + dims[None, :], mask=mask)
        v = tl.load(v_ptr + tok * v_tok_stride + heads[:, None] * v_head_stride + dims[None, :], mask=mask)
        # to the cache's dtype (a 16-bit cache under fp32 activations: round to nearest)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k[t], v[t] into cache slot slot_mapping[t] (Triton); same contract as ``store_kv_ref``.

    k and v may be strided views (e.g. slices of a fused QKV projection) as
    long as the head dim has unit stride. Slots are not bounds-checked on the
    device (that would cost a host sync): a slot >= num_blocks * block_size
    is undefined behaviour.

    Raises:
        ValueError: as ``store_kv_ref``, plus a non-unit head-dim stride.
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, shape {tuple(t.shape)} strides {t.stride()}")
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _triton.jit(_store_kv_kernel)[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=_triton.next_power_of_2(num_kv_heads),
        BLOCK_D=_triton.next_power_of_2(head_dim),
    )
