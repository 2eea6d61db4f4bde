"""Kernels for one step of a Llama-family model over a flattened batch.

Each op has a Triton kernel and a torch reference with the same signature;
``select_ops`` (``kernels.dispatch``) picks the set a model runs: the Triton kernels, or
the torch backend (``kernels.torch_ops``: the CPU attention of ``paged_attention_cpu``
with our C++ decode kernel, fused float32 small ops). Importing this package never needs triton: the
Triton kernels are compiled (or interpreted) on first launch.

Shapes: T tokens in the step, B sequences, Hq/Hkv query/KV heads, D head dim.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention_metadata import AttentionLayout, AttentionMetadata
from kernels.dispatch import BACKENDS, KernelOps, resolve_backend, select_ops
from kernels.kv_store import store_kv, store_kv_ref
from kernels.paged_attention import AttentionWork, paged_attention, paged_attention_ref, plan_attention_work
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rotary_embedding, rotary_embedding_ref

__all__ = [
    "BACKENDS",
    "KernelOps",
    "select_ops",
    "resolve_backend",
    "AttentionLayout",
    "AttentionMetadata",
    "paged_attention",
    "paged_attention_ref",
    "AttentionWork",
    "plan_attention_work",
    "store_kv",
    "store_kv_ref",
    "rms_norm",
    "rms_norm_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
