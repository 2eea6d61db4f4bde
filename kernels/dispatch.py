"""One switch between the kernel backends: the only way the model reaches a kernel.

The model runner asks once, at start-up, ``select_ops(backend, device, layout)`` and
calls the returned ``KernelOps``: ``plan_step`` once per step, the other fields in
every layer. Neither the runner nor the model imports an attention or small-op kernel
module. (The linear layers are the one other route, and a separate concern: each is a
``Linear`` that ``service.worker.quantization`` chose by measurement.)

Backends:
- "triton": the Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, tests).
- "torch": ``kernels.torch_ops``: attention through ``kernels.paged_attention_cpu`` (our
  C++ decode kernel or SDPA), float32 small ops in C++ on the CPU (``kernels.rowwise_cpu``)
  or as fused torch calls (a GPU without Triton, or no C++ build), the references for other
  dtypes. This is what serves on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import _triton
from kernels.attention_metadata import AttentionLayout

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The kernels of one model step. Shapes: T tokens, B sequences, H hidden, D head dim.

    Fields:
        plan_step(query_lens [B], seq_lens [B], cu_seqlens_q [B+1] int64 host,
            block_tables [B, max_blocks] int64 host, device) -> the step's attention plan
            (``AttentionMetadata.plan``); once per step.
        attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], kv [2,blocks,block_size,Hkv,D],
            meta, scale) -> [T,Hq,D]: stores this step's K/V at meta.slot_mapping, attends.
        rms_norm(x [T,H], weight [H], eps) -> [T,H]
        fused_add_rms_norm(x, residual, weight, eps) -> (norm(x + residual), x + residual);
            x may be overwritten.
        rotary_tables(cos, sin [max_position, D/2], positions [T]) -> (cos, sin) gathered
            in the layout rotary_qkv takes.
        rotary_qkv(qkv [T,(Hq+2Hkv)D], cos, sin, Hq, Hkv, D) -> (q, k rotated, v);
            qkv may be overwritten (the C++ row ops rotate it in place).
        silu_and_mul(x [T,2I]) -> [T,I]
        name: "triton" or "torch".
    """

    plan_step: Callable[..., object]
    attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_tables: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    name: str


def _torch_ops(layout: AttentionLayout, device: torch.device) -> KernelOps:
    from kernels import rowwise_cpu, torch_ops

    if layout.dtype != torch.float32:
        table = torch_ops.REFERENCES
    elif device.type == "cpu" and rowwise_cpu.build_problem() is None:
        table = torch_ops.ROWWISE_F32
    else:
        table = torch_ops.FUSED_F32
    return KernelOps(plan_step=functools.partial(torch_ops.plan_step_cpu, layout),
                     name="torch", **table)


def _triton_plan_step(layout: AttentionLayout, query_lens, seq_lens, cu_seqlens_q,
                      block_tables, device):
    from kernels.paged_attention import plan_attention_work

    return plan_attention_work(cu_seqlens_q, layout.num_heads, layout.num_kv_heads, device)


def _triton_attention(q, k, v, kv, meta, scale):
    from kernels.kv_store import store_kv
    from kernels.paged_attention import paged_attention

    store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
    return paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                           meta.cu_seqlens_q, scale, work=meta.plan)


def _triton_rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim):
    from kernels.rotary import rotary_embedding
    from kernels.torch_ops import split_qkv

    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = rotary_embedding(q, k, cos, sin)
    return q, k, v


def _triton_ops(layout: AttentionLayout) -> KernelOps:
    from kernels.activation import silu_and_mul
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.torch_ops import rotary_tables_ref

    return KernelOps(
        plan_step=functools.partial(_triton_plan_step, layout),
        attention=_triton_attention,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_tables=rotary_tables_ref,
        rotary_qkv=_triton_rotary_qkv,
        silu_and_mul=silu_and_mul,
        name="triton",
    )


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """"triton" or "torch" for ``backend`` on ``device`` (see ``select_ops``).

    Raises:
        ValueError: as ``select_ops``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton.triton_available() else "torch"
    if not _triton.triton_available():
        raise ValueError("attention backend 'triton' requested but the triton package cannot be imported")
    if device.type != "cuda" and not _triton.interpret_enabled():
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, got {device}; "
            "set TRITON_INTERPRET=1 (before triton is first used) to run the kernels "
            "in the Triton interpreter on CPU (tests only: very slow)"
        )
    return "triton"


def select_ops(backend: str, device: torch.device | str,
               layout: AttentionLayout | None = None) -> KernelOps:
    """Pick the kernel implementations for ``device``.

    Args:
        backend: "auto" (Triton on CUDA when triton imports, torch otherwise),
            "triton" or "torch".
        device: where the model's tensors live.
        layout: the model's attention layout (heads, dtype, block size, decode kernel);
            None: a float32 layout of 1 head of 16 (tests of the choice itself).

    Returns:
        The ``KernelOps`` to call.

    Raises:
        ValueError: unknown backend; "triton" when triton is not importable,
            or on a non-CUDA device without ``TRITON_INTERPRET=1`` (the
            interpreter is for tests: very slow).
    """
    layout = layout or AttentionLayout(num_heads=1, num_kv_heads=1, head_dim=16)
    if resolve_backend(backend, device) == "triton":
        return _triton_ops(layout)
    return _torch_ops(layout, torch.device(device))
