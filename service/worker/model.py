"""A lean Llama-family forward over a flattened, paged batch (Llama, Mistral, Qwen2, SmolLM).

The model knows nothing of requests, blocks or scheduling: it gets token ids,
positions and the attention metadata of one step, and reads and writes the
per-layer KV cache tensors it is handed. Weights are fused once at load (q|k|v and
gate|up) in the `[out, in]` layout that `F.linear` reads fastest; `quantize_int8`
turns them into int8 layers after a calibration pass (`service.worker.quantization`).

Two kernel paths:
- Triton (CUDA): every kernel through one `KernelOps` (`kernels.select_ops`).
- torch (CPU): attention through `kernels.paged_attention_cpu` with a plan made
  once per step; in fp32 the small ops are fused torch calls with the same math as
  the kernels' torch references (RMSNorm by `torch.rms_norm`, bit-identical; the
  rotary embedding of q and k in one pass over the fused projection; K/V stored
  with `index_copy_`), because on a CPU each extra op costs microseconds of
  dispatch on every layer of every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import KernelOps
from kernels.paged_attention import AttentionWork
from kernels.paged_attention_cpu import CpuAttentionPlan, cpu_paged_attention
from service.worker.loader import LoadedModel
from service.worker.quantization import (AmaxObserver, DenseLinear, Int8Linear, Linear,
                                  smoothing_factors)


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one step's flattened batch of B sequences and T tokens.

    slot_mapping: [T] int64, KV cache slot (block_id * block_size + offset) of each token,
        never -1 (every token of the step is written).
    block_tables: [B, max_blocks] int32. seq_lens: [B] int32 context incl. this step.
    cu_seqlens_q: [B+1] int32 query start offsets.
    work: the Triton kernel's (sequence, query tile) grid, planned once per step.
    cpu_plan: the torch path's attention plan, made once per step.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    work: AttentionWork | None = None      # Triton grid plan (None on the torch path)
    cpu_plan: CpuAttentionPlan | None = None  # torch path plan (None on Triton)


class SectionTimer:
    """Wall time of a step split into named sections (benchmarks only).

    `start()` then `lap(name)` after each section adds the time since the previous
    mark to `seconds[name]`. On CUDA every mark synchronises the device, so only pass
    a timer when measuring.
    """

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = device.type == "cuda"
        self._last = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._last = self._now()

    def lap(self, section: str) -> None:
        now = self._now()
        self.seconds[section] = self.seconds.get(section, 0.0) + now - self._last
        self._last = now


@dataclass
class _Layer:
    qkv: Linear        # [H] -> [(Hq + 2 Hkv) D], bias for Qwen2
    o: Linear          # [Hq D] -> [H]
    gate_up: Linear    # [H] -> [2 I]
    down: Linear       # [I] -> [H]
    ln1_w: torch.Tensor  # [H]
    ln2_w: torch.Tensor  # [H]


class LlamaModel:
    """Weights and forward of a Llama-family decoder.

    Args:
        loaded: config and HF-named weights from `service.worker.loader.load_model`.
        ops: the kernels to use.
        device, dtype: where and in what the weights live (dense; see `quantize_int8`).
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
        self.quantization: str | None = None  # "int8" after quantize_int8()
        # The torch path's fused fp32 ops (see the module docstring).
        self.lean = ops.name == "torch" and dtype == torch.float32

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in w else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return DenseLinear(weight, bias)

        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biases = [maybe(a + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(_Layer(
                qkv=linear(torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"]),
                           torch.cat(biases) if all(b is not None for b in biases) else None),
                o=linear(get(a + "o_proj.weight")),
                gate_up=linear(torch.cat([get(p + "mlp.gate_proj.weight"),
                                          get(p + "mlp.up_proj.weight")])),
                down=linear(get(p + "mlp.down_proj.weight")),
                ln1_w=get(p + "input_layernorm.weight"),
                ln2_w=get(p + "post_attention_layernorm.weight"),
            ))
        self.embed = get("model.embed_tokens.weight")                   # [V, H]
        self.norm_w = get("model.norm.weight")                          # [H]
        lm_head = maybe("lm_head.weight")
        self.lm_head = linear(self.embed if lm_head is None else lm_head)  # tied: [V, H]
        # rotary tables: [max_position, D/2], the Llama rotate-half convention
        pos = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, loaded.inv_freq.float())
        self.cos = (freqs.cos() * loaded.attention_scaling).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * loaded.attention_scaling).to(device=device, dtype=dtype)

    @contextmanager
    def observe_linear_inputs(self) -> Iterator[list[dict[str, AmaxObserver]]]:
        """Within the block, every layer's linears record their inputs' per-channel max |x|.

        Yields one {"qkv", "o", "gate_up", "down"} -> AmaxObserver dict per layer; the
        layers are restored on exit.
        """
        names = ("qkv", "o", "gate_up", "down")
        observed = [{n: AmaxObserver(getattr(layer, n)) for n in names} for layer in self.layers]
        for layer, obs in zip(self.layers, observed):
            for n in names:
                setattr(layer, n, obs[n])
        try:
            yield observed
        finally:
            for layer, obs in zip(self.layers, observed):
                for n in names:
                    setattr(layer, n, obs[n].inner)

    def quantize_int8(self, observed: list[dict[str, AmaxObserver]]) -> None:
        """Replace the dense linear layers (LM head included) by int8 ones, SmoothQuant-ed.

        observed: from `observe_linear_inputs` after a forward over calibration text.
        Per layer, each smoothing factor s is folded where it cancels exactly:
            qkv input     = rms_norm(h) * ln1_w  -> ln1_w / s, qkv columns * s
            gate_up input = rms_norm(h) * ln2_w  -> ln2_w / s, gate_up columns * s
            down input    = silu(gate) * up      -> up rows / s, down columns * s
            o input       = attention(v)         -> v rows / s, o columns * s, one s per
                            V channel shared by the Hq / Hkv query heads reading it.
        The down projection and the LM head quantize activations per token.

        Raises:
            ValueError: the model is not dense fp32 on the CPU, or a layer saw no input.
        """
        if self.quantization is not None or self.embed.dtype != torch.float32 or \
                self.embed.device.type != "cpu":
            raise ValueError("int8 quantization needs a dense float32 model on the CPU")
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = Hq // Hkv
        for i, (layer, obs) in enumerate(zip(self.layers, observed)):
            if any(o.amax is None for o in obs.values()):
                raise ValueError(f"layer {i}: no calibration input was observed")
            qkv, o, gate_up, down = (obs[n].inner for n in ("qkv", "o", "gate_up", "down"))
            qkv_w, o_w = qkv.weight.clone(), o.weight.clone()
            gate_up_w, down_w = gate_up.weight.clone(), down.weight.clone()
            qkv_b = None if qkv.bias is None else qkv.bias.clone()
            ln1_w, ln2_w = layer.ln1_w.clone(), layer.ln2_w.clone()
            s = smoothing_factors(obs["qkv"].amax, qkv_w.abs().amax(0))
            ln1_w /= s
            qkv_w *= s
            s = smoothing_factors(obs["gate_up"].amax, gate_up_w.abs().amax(0))
            ln2_w /= s
            gate_up_w *= s
            s = smoothing_factors(obs["down"].amax, down_w.abs().amax(0))
            gate_up_w[gate_up_w.shape[0] // 2:] /= s[:, None]  # the up half
            down_w *= s
            # [Hq D] -> [Hkv, G, D] -> max over the G heads that share a V channel
            s = smoothing_factors(obs["o"].amax.view(Hkv, G, D).amax(1).reshape(-1),
                                  o_w.abs().amax(0).view(Hkv, G, D).amax(1).reshape(-1))
            o_w *= s.view(Hkv, 1, D).expand(Hkv, G, D).reshape(-1)
            v_rows = slice((Hq + Hkv) * D, (Hq + 2 * Hkv) * D)
            qkv_w[v_rows] /= s[:, None]
            if qkv_b is not None:
                qkv_b[v_rows] /= s
            layer.qkv = Int8Linear(qkv_w, qkv_b)
            layer.o = Int8Linear(o_w)
            layer.gate_up = Int8Linear(gate_up_w)
            layer.down = Int8Linear(down_w, per_token=True)
            layer.ln1_w, layer.ln2_w = ln1_w, ln2_w
        assert isinstance(self.lm_head, DenseLinear)
        self.lm_head = Int8Linear(self.lm_head.weight, self.lm_head.bias, per_token=True)
        self.quantization = "int8"

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logits_indices: torch.Tensor,
                timer: SectionTimer | None = None) -> torch.Tensor:
        """One step.

        input_ids, positions: [T] int64. kv_caches: one [2, num_blocks, block_size, Hkv, D]
        tensor per layer, written in place at meta.slot_mapping. logits_indices: [S] int64
        rows of the batch that sample. timer: adds the step's time to its "linear",
        "attention" (K/V store included) and "other" sections. Returns logits [S, V] float32.
        """
        tm = timer
        T = input_ids.shape[0]
        q_size = self.num_heads * self.head_dim
        cos, sin = self.cos[positions], self.sin[positions]          # [T, D/2]
        if self.lean:
            cos, sin = cos[:, None, :], sin[:, None, :]              # [T, 1, D/2]
        h = F.embedding(input_ids, self.embed)                       # [T, H]
        residual = h
        x = self._norm(h, self.layers[0].ln1_w)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i > 0:
                x, residual = self._add_norm(h, residual, layer.ln1_w)
            if tm is not None:
                tm.lap("other")
            qkv = layer.qkv(x)                                       # [T, (Hq + 2 Hkv) D]
            if tm is not None:
                tm.lap("linear")
            q, k, v = self._rotary(qkv, cos, sin)                    # [T, Hq|Hkv|Hkv, D]
            if tm is not None:
                tm.lap("other")
            o = self._attention(q, k, v, kv, meta)                   # [T, Hq, D]
            if tm is not None:
                tm.lap("attention")
            h = layer.o(o.reshape(T, q_size))                        # [T, H]
            if tm is not None:
                tm.lap("linear")
            x, residual = self._add_norm(h, residual, layer.ln2_w)
            if tm is not None:
                tm.lap("other")
            gate_up = layer.gate_up(x)                               # [T, 2 I]
            if tm is not None:
                tm.lap("linear")
            act = self._silu_and_mul(gate_up)                        # [T, I]
            if tm is not None:
                tm.lap("other")
            h = layer.down(act)                                      # [T, H]
            if tm is not None:
                tm.lap("linear")
        last = h[logits_indices] + residual[logits_indices]          # [S, H]: only sampling rows
        last = self._norm(last, self.norm_w)
        if tm is not None:
            tm.lap("other")
        logits = self.lm_head(last).float()                          # [S, V]
        if tm is not None:
            tm.lap("linear")
        return logits

    # ---- the small ops: fused torch calls on the lean path, KernelOps otherwise --------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.lean:
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        return self.ops.rms_norm(x, w, self.eps)

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor,
                  w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h + residual), h + residual); h, a fresh layer output, may be reused."""
        if self.lean:
            residual = h.add_(residual)
            return torch.rms_norm(residual, (residual.shape[-1],), w, self.eps), residual
        return self.ops.fused_add_rms_norm(h, residual, w, self.eps)

    def _rotary(self, qkv: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection into q, k, v and rotate q and k."""
        T = qkv.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if not self.lean:
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q, k = self.ops.rotary_embedding(q.view(T, Hq, D), k.view(T, Hkv, D),
                                             cos, sin)
            return q, k, v.reshape(T, Hkv, D)
        # q and k heads side by side, rotated in one pass: [T, Hq + Hkv, D]. Same values as
        # rotary_embedding_ref: x1 c - x2 s | x2 c + x1 s (HF's q cos + rotate_half(q) sin).
        qk = qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
        half = D // 2
        x1, x2 = qk[..., :half], qk[..., half:]
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, Hq + Hkv, D]
        return rot[:, :Hq], rot[:, Hq:], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """Store this step's K/V at meta.slot_mapping, then attend. Returns [T, Hq, D]."""
        plan = meta.cpu_plan
        if plan is None:
            self.ops.store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
            return self.ops.paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                                            meta.cu_seqlens_q, self.scale, work=meta.work)
        T = k.shape[0]
        width = self.num_kv_heads * self.head_dim
        kv.view(2, -1, width)[0].index_copy_(0, meta.slot_mapping, k.reshape(T, width))
        kv.view(2, -1, width)[1].index_copy_(0, meta.slot_mapping, v.reshape(T, width))
        return cpu_paged_attention(q, kv[0], kv[1], plan, self.scale)

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.lean:
            half = gate_up.shape[1] // 2
            return F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])
        return self.ops.silu_and_mul(gate_up)
