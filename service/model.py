"""A lean Llama-family forward over a flattened, paged batch (Llama, Mistral, Qwen2, SmolLM).

The model knows nothing of requests, blocks or scheduling: it gets token ids,
positions and the attention metadata of one step, and reads and writes the
per-layer KV cache tensors it is handed. Weights are fused once at load (q|k|v and
gate|up) in the `[out, in]` layout that `F.linear` reads fastest. Every kernel goes
through one `KernelOps` (Triton on CUDA, torch references elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import KernelOps
from kernels.paged_attention import AttentionWork
from service.loader import LoadedModel


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one step's flattened batch of B sequences and T tokens.

    slot_mapping: [T] int64, KV cache slot (block_id * block_size + offset) of each token.
    block_tables: [B, max_blocks] int32. seq_lens: [B] int32 context incl. this step.
    cu_seqlens_q: [B+1] int32 query start offsets.
    work: the Triton kernel's (sequence, query tile) grid, planned once per step.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    work: AttentionWork | None = None  # Triton grid plan, made once per step (None on torch)


@dataclass
class _Layer:
    qkv_w: torch.Tensor            # [(Hq + 2 Hkv) D, H]
    qkv_b: torch.Tensor | None     # [(Hq + 2 Hkv) D]
    o_w: torch.Tensor              # [H, Hq D]
    gate_up_w: torch.Tensor        # [2 I, H]
    down_w: torch.Tensor           # [H, I]
    ln1_w: torch.Tensor            # [H]
    ln2_w: torch.Tensor            # [H]


class LlamaModel:
    """Weights and forward of a Llama-family decoder.

    Args:
        loaded: config and HF-named weights from `service.loader.load_model`.
        ops: the kernels to use.
        device, dtype: where and in what the weights live.
    """

    def __init__(self, loaded: LoadedModel, ops: KernelOps, device: torch.device,
                 dtype: torch.dtype) -> None:
        cfg = loaded.hf_config
        w = loaded.weights
        self.ops = ops
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.max_position = int(cfg.max_position_embeddings)

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in w else None

        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biases = [maybe(a + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(_Layer(
                qkv_w=torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"]).contiguous(),
                qkv_b=torch.cat(biases).contiguous() if all(b is not None for b in biases) else None,
                o_w=get(a + "o_proj.weight"),
                gate_up_w=torch.cat([get(p + "mlp.gate_proj.weight"),
                                     get(p + "mlp.up_proj.weight")]).contiguous(),
                down_w=get(p + "mlp.down_proj.weight"),
                ln1_w=get(p + "input_layernorm.weight"),
                ln2_w=get(p + "post_attention_layernorm.weight"),
            ))
        self.embed = get("model.embed_tokens.weight")                   # [V, H]
        self.norm_w = get("model.norm.weight")                          # [H]
        self.lm_head = maybe("lm_head.weight")
        if self.lm_head is None:  # tied embeddings
            self.lm_head = self.embed                                    # [V, H]
        # rotary tables: [max_position, D/2], the Llama rotate-half convention
        pos = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, loaded.inv_freq.float())
        self.cos = (freqs.cos() * loaded.attention_scaling).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * loaded.attention_scaling).to(device=device, dtype=dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logits_indices: torch.Tensor) -> torch.Tensor:
        """One step.

        input_ids, positions: [T] int64. kv_caches: one [2, num_blocks, block_size, Hkv, D]
        tensor per layer, written in place at meta.slot_mapping. logits_indices: [S] int64
        rows of the batch that sample. Returns logits [S, V] float32.
        """
        ops = self.ops
        T = input_ids.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = Hq * D, Hkv * D
        cos, sin = self.cos[positions], self.sin[positions]          # [T, D/2]
        h = F.embedding(input_ids, self.embed)                       # [T, H]
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, layer.ln1_w, self.eps)           # [T, H]
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, layer.ln1_w, self.eps)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)              # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = ops.rotary_embedding(q.view(T, Hq, D), k.view(T, Hkv, D), cos, sin)
            v = v.reshape(T, Hkv, D)
            ops.store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
            o = ops.paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                                    meta.cu_seqlens_q, self.scale, work=meta.work)  # [T, Hq, D]
            h = F.linear(o.reshape(T, q_size), layer.o_w)            # [T, H]
            x, residual = ops.fused_add_rms_norm(h, residual, layer.ln2_w, self.eps)
            gate_up = F.linear(x, layer.gate_up_w)                   # [T, 2 I]
            h = F.linear(ops.silu_and_mul(gate_up), layer.down_w)    # [T, H]
        assert residual is not None
        last = (h + residual)[logits_indices]                        # [S, H]: only sampling rows
        last = ops.rms_norm(last, self.norm_w, self.eps)
        return F.linear(last, self.lm_head).float()                  # [S, V]
