"""One switch between the Triton kernels and their torch references.

The model runner asks once, at start-up, ``select_ops(backend, device)`` and
calls the returned ``KernelOps`` in every layer; it never imports a kernel
module directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import _triton

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The kernels of one model step (signatures as in ``kernels/__init__``).

    Fields:
        paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale) -> out
        store_kv(k, v, k_cache, v_cache, slot_mapping) -> None
        rms_norm(x, weight, eps) -> out
        fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
        rotary_embedding(q, k, cos, sin) -> (q_out, k_out)
        silu_and_mul(x) -> out
        name: "triton" or "torch".
    """

    paged_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    name: str


def _torch_ops() -> KernelOps:
    from kernels.activation import silu_and_mul_ref
    from kernels.kv_store import store_kv_ref
    from kernels.paged_attention import paged_attention_ref
    from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.rotary import rotary_embedding_ref

    return KernelOps(
        paged_attention=paged_attention_ref,
        store_kv=store_kv_ref,
        rms_norm=rms_norm_ref,
        fused_add_rms_norm=fused_add_rms_norm_ref,
        rotary_embedding=rotary_embedding_ref,
        silu_and_mul=silu_and_mul_ref,
        name="torch",
    )


def _triton_ops() -> KernelOps:
    from kernels.activation import silu_and_mul
    from kernels.kv_store import store_kv
    from kernels.paged_attention import paged_attention
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    return KernelOps(
        paged_attention=paged_attention,
        store_kv=store_kv,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
        name="triton",
    )


def select_ops(backend: str, device: torch.device) -> KernelOps:
    """Pick the kernel implementations for ``device``.

    Args:
        backend: "auto" (Triton on CUDA when triton imports, torch otherwise),
            "triton" or "torch".
        device: where the model's tensors live.

    Returns:
        The ``KernelOps`` to call.

    Raises:
        ValueError: unknown backend; "triton" when triton is not importable,
            or on a non-CUDA device without ``TRITON_INTERPRET=1`` (the
            interpreter is for tests: very slow).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return _torch_ops()
    if backend == "auto":
        if device.type == "cuda" and _triton.triton_available():
            return _triton_ops()
        return _torch_ops()
    if not _triton.triton_available():
        raise ValueError("attention backend 'triton' requested but the triton package cannot be imported")
    if device.type != "cuda" and not _triton.interpret_enabled():
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, got {device}; "
            "set TRITON_INTERPRET=1 (before triton is first used) to run the kernels "
            "in the Triton interpreter on CPU (tests only: very slow)"
        )
    return _triton_ops()
