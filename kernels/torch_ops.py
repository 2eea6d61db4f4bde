"""The torch backend's ops (CPU, or a GPU without Triton), as ``KernelOps`` fields.

Attention: ``kernels.paged_attention_cpu``, planned once per step (decodes through our
C++ kernel or grouped SDPA, prefill chunks through SDPA). In float32 the small ops are
fused torch calls with the same math as the kernels' torch references (RMSNorm by
``torch.rms_norm``, bit-identical; the rotary embedding of q and k in one pass over the
fused projection; the residual added in place), because on a CPU each extra op costs
microseconds of dispatch on every layer of every step. Other dtypes use the references
(which compute in float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import rowwise_cpu
from kernels.activation import silu_and_mul_ref
from kernels.attention_metadata import AttentionLayout, AttentionMetadata
from kernels.paged_attention_cpu import CpuAttentionPlan, cpu_paged_attention, plan_cpu_attention
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_embedding_ref


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (views)."""
    T, D = qkv.shape[0], head_dim
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    return q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D)


def rotary_tables_ref(cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, D/2] gathered at positions [T]: [T, D/2] each."""
    return cos[positions], sin[positions]


def rotary_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection and rotate q and k (``rotary_embedding_ref``)."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = rotary_embedding_ref(q, k, cos, sin)
    return q, k, v


# ---- float32: fused torch calls, same math ----------------------------------------------
def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> RMSNorm(x) * weight, new tensor (bit-identical to ``rms_norm_ref``)."""
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm_f32(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, a fresh layer output, is overwritten."""
    residual = x.add_(residual)
    return torch.rms_norm(residual, (residual.shape[-1],), weight, eps), residual


def rotary_tables_f32(cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered at positions [T] and shaped [T, 1, D/2] for ``rotary_qkv_f32``."""
    return cos[positions][:, None, :], sin[positions][:, None, :]


def rotary_qkv_f32(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k heads side by side, rotated in one pass ([T, Hq + Hkv, D]); the same values
    as ``rotary_embedding_ref``: x1 c - x2 s | x2 c + x1 s (HF's q cos + rotate_half(q) sin).
    cos, sin: [T, 1, D/2] from ``rotary_tables_f32``. Returns q, k, v."""
    T, D, Hq, Hkv = qkv.shape[0], head_dim, num_heads, num_kv_heads
    qk = qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
    half = D // 2
    x1, x2 = qk[..., :half], qk[..., half:]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, Hq + Hkv, D]
    return rot[:, :Hq], rot[:, Hq:], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)


def silu_and_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    half = x.shape[1] // 2
    return F.silu(x[:, :half]).mul_(x[:, half:])


# ---- attention -----------------------------------------------------------------------
def plan_step_cpu(layout: AttentionLayout, query_lens: Sequence[int], seq_lens: Sequence[int],
                  cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                  device: torch.device) -> CpuAttentionPlan:
    """``plan_cpu_attention`` for one step (block_tables [B, max_blocks] int64, host)."""
    return plan_cpu_attention(query_lens, seq_lens, block_tables.to(device), layout.block_size,
                              layout.kv_bytes_per_token, decode_kernel=layout.decode_kernel,
                              all_rows=layout.all_rows,
                              prefill_bf16_dot=layout.prefill_bf16_dot)


def attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's K/V at meta.slot_mapping, then attend following meta.plan.

    q [T, Hq, D], k and v [T, Hkv, D], kv [2, num_blocks, block_size, Hkv, D] (any dtype,
    q's, or a 16-bit one under fp32 q: K/V rounded to it as stored). Returns [T, Hq, D]."""
    T = k.shape[0]
    width = kv.shape[-2] * kv.shape[-1]
    kv.view(2, -1, width)[0].index_copy_(0, meta.slot_mapping, k.reshape(T, width).to(kv.dtype))
    kv.view(2, -1, width)[1].index_copy_(0, meta.slot_mapping, v.reshape(T, width).to(kv.dtype))
    return cpu_paged_attention(q, kv[0], kv[1], meta.plan, scale)


REFERENCES = {"rms_norm": rms_norm_ref, "fused_add_rms_norm": fused_add_rms_norm_ref,
              "rotary_tables": rotary_tables_ref, "rotary_qkv": rotary_qkv_ref,
              "silu_and_mul": silu_and_mul_ref, "attention": attention_cpu}
FUSED_F32 = {"rms_norm": rms_norm_f32, "fused_add_rms_norm": fused_add_rms_norm_f32,
             "rotary_tables": rotary_tables_f32, "rotary_qkv": rotary_qkv_f32,
             "silu_and_mul": silu_and_mul_f32, "attention": attention_cpu}
ROWWISE_F32 = {"rms_norm": rowwise_cpu.rms_norm, "fused_add_rms_norm": rowwise_cpu.fused_add_rms_norm,
               "rotary_tables": rowwise_cpu.rotary_tables, "rotary_qkv": rowwise_cpu.rotary_qkv,
               "silu_and_mul": rowwise_cpu.silu_and_mul, "attention": attention_cpu}
"""float32 on the CPU where the C++ library builds: the small ops in C++ (``kernels.rowwise_cpu``),
FUSED_F32's torch calls otherwise."""
