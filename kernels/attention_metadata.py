"""What the kernels of one step need to know besides the tensors: the model's attention
layout (fixed at start-up) and one step's batch layout (made once per step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionLayout:
    """The attention shape of a model and how its steps are planned (fixed at start-up).

    num_heads, num_kv_heads, head_dim: Hq, Hkv, D (Hq a multiple of Hkv).
    dtype: of the activations (and of the KV cache unless kv_dtype says otherwise).
    block_size: tokens per KV cache block.
    decode_kernel: the torch backend's decode attention, "cpp" (our C++ kernel,
        ``kernels.decode_attention_cpu``) or "sdpa"; "none" on Triton.
    all_rows: batch invariance: prefill rows too through the C++ kernel, each over its
        own causal prefix (torch backend, decode_kernel "cpp").
    kv_dtype: of the KV cache (``--kv-cache-dtype``); None: dtype.
    prefill_bf16_dot: prefill chunks through the C++ kernel multiply in bf16 (AVX512-BF16;
        ``kernels.prefill_attention_cpu``'s bf16_dot): torch backend, decode_kernel "cpp".
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    decode_kernel: str = "sdpa"
    all_rows: bool = False
    kv_dtype: torch.dtype | None = None
    prefill_bf16_dot: bool = False

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: kv_dtype, or dtype when that is None."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K plus V in one layer: 2 Hkv D itemsize (the cache's)."""
        return 2 * self.num_kv_heads * self.head_dim * self.cache_dtype.itemsize


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one step's flattened batch of B sequences and T tokens.

    slot_mapping: [T] int64, KV cache slot (block_id * block_size + offset) of each token,
        never -1 (every token of the step is written).
    block_tables: [B, max_blocks] int32. seq_lens: [B] int32 context incl. this step.
    cu_seqlens_q: [B+1] int32 query start offsets.
    plan: the backend's attention plan for this step (``KernelOps.plan_step``): an
        ``AttentionWork`` grid for Triton, a ``CpuAttentionPlan`` for the torch backend.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    plan: object = None
