"""A Llama-family forward over a flattened, paged batch (Llama, Mistral, Qwen2, SmolLM).

The model knows nothing of requests, blocks or scheduling: it gets token ids,
positions and the attention metadata of one step, and reads and writes the
per-layer KV cache tensors it is handed. Weights are fused once at load (q|k|v and
gate|up) in the `[out, in]` layout that `F.linear` reads fastest; `quantize` replaces
each by the linear layer a quantization plan builds (`service.worker.quantization`), after
folding SmoothQuant factors where the plan quantizes activations.

Every op other than the linear layers goes through the `KernelOps` that
`kernels.select_ops` picked (Triton on CUDA; on the CPU, torch with our C++ decode
attention and fused float32 ops). On the CPU a step whose every row the C++ attention
kernel serves (decode-only steps; every step in the batch-invariant mode) runs instead as
one native call when `fused` has a forward for its row bucket (`service.worker.fused_forward`).
Benchmarks time the forward's sections from outside (`service.worker.section_timer`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from service.worker.loader import LoadedModel
from service.worker.quantization import AmaxObserver, DenseLinear, Linear
from service.worker.quantization.linear import PendingLinear
from service.worker.quantization.census import LAYER_CLASSES
from service.worker.quantization.plan import bucket_index
from service.worker.quantization.smoothing import fold_smoothing


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
        device, dtype: where and in what the weights live (dense; see `quantize`).
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
        self.quantization: str | None = None  # "int8" / "int4" / "auto" after quantize()
        # The fused forward per linear row bucket (service.worker.fused_forward), for steps
        # whose every row is a kernel row of the CPU attention plan; empty: never fused.
        self.fused: dict[int, Callable[..., torch.Tensor]] = {}

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in w else None

        def cat_bias(names: list[str], sizes: list[int]) -> torch.Tensor | None:
            """The parts' biases concatenated (zeros for a part without one), or None."""
            parts = [maybe(n) for n in names]
            if all(b is None for b in parts):
                return None
            return torch.cat([b if b is not None else torch.zeros(n, device=device, dtype=dtype)
                              for b, n in zip(parts, sizes)])

        blocks = loaded.gguf_linear if loaded.blocks_only else None

        def linear(key: tuple[int | None, str], weight_names: list[str],
                   bias: torch.Tensor | None) -> Linear:
            if blocks is not None:  # the file's own blocks: a kernel is put on them later
                return PendingLinear(blocks.layers[key], bias)  # type: ignore[attr-defined]
            return DenseLinear(torch.cat([get(n) for n in weight_names]), bias)

        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        inter = cfg.intermediate_size
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            self.layers.append(_Layer(
                qkv=linear((i, "qkv"), [a + f"{x}_proj.weight" for x in "qkv"],
                           cat_bias([a + f"{x}_proj.bias" for x in "qkv"],
                                    [Hq * D, Hkv * D, Hkv * D])),
                o=linear((i, "o"), [a + "o_proj.weight"], maybe(a + "o_proj.bias")),
                gate_up=linear((i, "gate_up"), [m + "gate_proj.weight", m + "up_proj.weight"],
                               cat_bias([m + "gate_proj.bias", m + "up_proj.bias"],
                                        [inter, inter])),
                down=linear((i, "down"), [m + "down_proj.weight"], maybe(m + "down_proj.bias")),
                ln1_w=get(p + "input_layernorm.weight"),
                ln2_w=get(p + "post_attention_layernorm.weight"),
            ))
        self.norm_w = get("model.norm.weight")                          # [H]
        # [V, H] float32 table, or the file's blocks (rows dequantized when looked up)
        self.embed: torch.Tensor | None = None
        self.block_embed = loaded.embedding if loaded.blocks_only else None
        if self.block_embed is None:
            self.embed = get("model.embed_tokens.weight")
            lm_head = maybe("lm_head.weight")
            self.lm_head: Linear = DenseLinear(self.embed if lm_head is None else lm_head)
        else:
            self.lm_head = linear((None, "lm_head"), [], None)
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

    def linears(self) -> list[Linear]:
        """Every linear layer a forward runs: each decoder layer's qkv, o, gate_up and down,
        in layer order, then the LM head."""
        return [getattr(layer, n) for layer in self.layers for n in LAYER_CLASSES] + [self.lm_head]

    def linear_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Per linear shape class ("qkv", "o", "gate_up", "down", "lm_head"): the first
        layer's dense weight [N, K], or None where the model holds only its blocks (the
        choice reads those), and bias [N] or None (what kernel choice times)."""
        first = self.layers[0]
        out = {n: getattr(first, n) for n in ("qkv", "o", "gate_up", "down")}
        out["lm_head"] = self.lm_head
        for n, lin in out.items():
            if not isinstance(lin, (DenseLinear, PendingLinear)):
                raise ValueError(f"{n} is already quantized")
        return {n: (lin.weight if isinstance(lin, DenseLinear) else None, lin.bias)
                for n, lin in out.items()}

    @property
    def blocks_only(self) -> bool:
        """Whether the linear layers are a checkpoint's blocks awaiting their kernels."""
        return isinstance(self.lm_head, PendingLinear)

    def quantize(self, make_linear: Callable[[str, torch.Tensor | None, torch.Tensor | None,
                                              int | None], Linear],
                 mode: str | None, observed: list[dict[str, AmaxObserver]] | None = None,
                 smooth: Collection[str] = ()) -> None:
        """Replace every linear layer (LM head included) by
        ``make_linear(class, weight, bias, layer index or None for the LM head)``, after
        folding SmoothQuant factors into the
        inputs of the classes in `smooth` (those served by activation-quantizing paths).
        A model read as a checkpoint's blocks (``blocks_only``) passes weight None: the plan
        finds the layer's blocks itself; each layer's file pages are released once served.

        mode: the model's quantization label afterwards (None: still fp32 weights).
        observed: from `observe_linear_inputs` after a forward over calibration text
            (needed when `smooth` is not empty). The folding: ``fold_smoothing``. The LM
            head (tied to the embedding) is never smoothed.

        Raises:
            ValueError: the model is not dense fp32 on the CPU nor blocks, or a smoothed
                layer saw no calibration input, or smoothing is asked of blocks.
        """
        smooth = frozenset(smooth) - {"lm_head"}
        if self.blocks_only:
            if self.quantization is not None or smooth:
                raise ValueError("a model read as blocks takes one plan, without smoothing")
            for i, layer in enumerate(self.layers):
                for n in LAYER_CLASSES:
                    lin = getattr(layer, n)
                    setattr(layer, n, make_linear(n, None, lin.bias, i))
                    lin.blocks.release()
            head = self.lm_head
            self.lm_head = make_linear("lm_head", None, None, None)
            head.blocks.release()  # type: ignore[attr-defined]
            self.quantization = mode
            self.fused = {}
            return
        if self.quantization is not None or self.embed is None or \
                self.embed.dtype != torch.float32 or self.embed.device.type != "cpu" or \
                not isinstance(self.lm_head, DenseLinear):
            raise ValueError("quantization needs a dense float32 model on the CPU")
        if smooth and observed is None:
            raise ValueError(f"smoothing {sorted(smooth)} needs observed calibration inputs")
        for i, layer in enumerate(self.layers):
            obs = observed[i] if observed is not None else {}
            inner = {n: obs[n].inner if n in obs else getattr(layer, n)
                     for n in ("qkv", "o", "gate_up", "down")}
            w = fold_smoothing(
                {"qkv_w": inner["qkv"].weight, "qkv_b": inner["qkv"].bias,
                 "o_w": inner["o"].weight, "gate_up_w": inner["gate_up"].weight,
                 "gate_up_b": inner["gate_up"].bias,
                 "down_w": inner["down"].weight, "ln1_w": layer.ln1_w, "ln2_w": layer.ln2_w},
                {n: o.amax for n, o in obs.items()}, smooth,
                self.num_heads, self.num_kv_heads, self.head_dim, where=f"layer {i}")
            layer.qkv = make_linear("qkv", w["qkv_w"], w["qkv_b"], i)
            layer.o = make_linear("o", w["o_w"], inner["o"].bias, i)
            layer.gate_up = make_linear("gate_up", w["gate_up_w"], w["gate_up_b"], i)
            layer.down = make_linear("down", w["down_w"], inner["down"].bias, i)
            layer.ln1_w, layer.ln2_w = w["ln1_w"], w["ln2_w"]
        self.lm_head = make_linear("lm_head", self.lm_head.weight, self.lm_head.bias, None)
        self.quantization = mode
        self.fused = {}  # built over the old linears: the runner builds it anew

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> their embeddings [T, H] float32."""
        if self.block_embed is not None:
            return self.block_embed(input_ids)
        assert self.embed is not None
        return F.embedding(input_ids, self.embed)

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
        T = input_ids.shape[0]
        if self.fused and meta.plan.kernel_rows_only:
            fused = self.fused.get(bucket_index(T))
            if fused is not None:  # the whole forward in one native call
                kd = meta.plan.kernel_decodes
                return fused(input_ids, positions, meta.slot_mapping, kd.block_tables,
                             kd.seq_lens, logits_indices)
        ops, eps = self.ops, self.eps
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = ops.rotary_tables(self.cos, self.sin, positions)    # gathered: [T, ..D/2]
        h = self.embed_tokens(input_ids)                               # [T, H]
        residual = h
        x = ops.rms_norm(h, self.layers[0].ln1_w, eps)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i > 0:
                x, residual = ops.fused_add_rms_norm(h, residual, layer.ln1_w, eps)
            qkv = layer.qkv(x)                                         # [T, (Hq + 2 Hkv) D]
            q, k, v = ops.rotary_qkv(qkv, cos, sin, Hq, Hkv, D)        # [T, Hq|Hkv|Hkv, D]
            o = ops.attention(q, k, v, kv, meta, self.scale)           # [T, Hq, D]
            h = layer.o(o.reshape(T, Hq * D))                          # [T, H]
            x, residual = ops.fused_add_rms_norm(h, residual, layer.ln2_w, eps)
            gate_up = layer.gate_up(x)                                 # [T, 2 I]
            h = layer.down(ops.silu_and_mul(gate_up))                  # [T, I] -> [T, H]
        last = h[logits_indices] + residual[logits_indices]            # [S, H]: sampling rows
        last = ops.rms_norm(last, self.norm_w, eps)
        return self.lm_head(last).float()                              # [S, V]
