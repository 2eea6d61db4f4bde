"""The layer shapes of real models, for random-weight checkpoints (``scripts/make_models``).

Each shape is its model's published ``config.json`` (the sources are named beside it)
except the vocabulary: every shape uses SmolLM2-135M-Instruct's 49,152 tokens, whose
tokenizer the written files carry (the real vocabularies are 128,256 for Llama 3, 152,064
for Qwen2.5-7B and 32,768 for Mistral v0.3: their embedding and LM head rows differ).

``tensors(shape)`` lists a checkpoint's tensors in llama.cpp's GGUF names and its HF names,
with their shapes as numpy sees them (``[out, in]`` for a linear layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class ModelShape:
    """One decoder's shape. arch: llama.cpp's GGUF architecture ("llama" for Llama and
    Mistral, "qwen2"); model_type: transformers' ("llama", "mistral", "qwen2")."""

    name: str
    arch: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_theta: float
    rms_eps: float
    context: int
    rope_scaling: dict | None = None   # HF's rope_scaling (llama3) or None
    qkv_bias: bool = False
    vocab: int = SMOLLM2_VOCAB
    source: str = ""
    extra_config: dict = field(default_factory=dict)  # more HF config.json fields

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"arch: {self.arch!r} (allowed: llama, qwen2)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")


def _llama3(factor: float) -> dict:
    return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3.2-1b", "llama", "llama", hidden=2048, layers=16, heads=32, kv_heads=8,
               head_dim=64, ffn=8192, tied=True, rope_theta=500000.0, rms_eps=1e-5,
               context=131072, rope_scaling=_llama3(32.0),
               source="https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json"),
    ModelShape("llama-3.2-3b", "llama", "llama", hidden=3072, layers=28, heads=24, kv_heads=8,
               head_dim=128, ffn=8192, tied=True, rope_theta=500000.0, rms_eps=1e-5,
               context=131072, rope_scaling=_llama3(32.0),
               source="https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json"),
    ModelShape("llama-3.1-8b", "llama", "llama", hidden=4096, layers=32, heads=32, kv_heads=8,
               head_dim=128, ffn=14336, tied=False, rope_theta=500000.0, rms_eps=1e-5,
               context=131072, rope_scaling=_llama3(8.0),
               source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    ModelShape("qwen2.5-7b", "qwen2", "qwen2", hidden=3584, layers=28, heads=28, kv_heads=4,
               head_dim=128, ffn=18944, tied=False, rope_theta=1000000.0, rms_eps=1e-6,
               context=131072, qkv_bias=True,
               extra_config={"use_sliding_window": False, "sliding_window": 131072,
                             "max_window_layers": 28},
               source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"),
    ModelShape("mistral-7b-v0.3", "llama", "mistral", hidden=4096, layers=32, heads=32,
               kv_heads=8, head_dim=128, ffn=14336, tied=False, rope_theta=1000000.0,
               rms_eps=1e-5, context=32768, extra_config={"sliding_window": None},
               source="https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json"),
)}


@dataclass(frozen=True)
class TensorSpec:
    """gguf_name / hf_name: the tensor's name in each format (hf_name None: GGUF only);
    shape: numpy's ([out, in] for a linear); layer: its block index, or None;
    kind: "linear", "embed", "norm", "bias" or "rope_freqs"."""

    gguf_name: str
    hf_name: str | None
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensors(s: ModelShape) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in the order llama.cpp's converter writes them."""
    H, V, I = s.hidden, s.vocab, s.ffn
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = []
    if s.rope_scaling is not None and s.rope_scaling.get("rope_type") == "llama3":
        out.append(TensorSpec("rope_freqs.weight", None, (s.head_dim // 2,), "rope_freqs"))
    out.append(TensorSpec("token_embd.weight", "model.embed_tokens.weight", (V, H), "embed"))
    for i in range(s.layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        a = h + "self_attn."
        out.append(TensorSpec(g + "attn_norm.weight", h + "input_layernorm.weight", (H,), "norm", i))
        out.append(TensorSpec(g + "attn_q.weight", a + "q_proj.weight", (q, H), "linear", i))
        out.append(TensorSpec(g + "attn_k.weight", a + "k_proj.weight", (kv, H), "linear", i))
        out.append(TensorSpec(g + "attn_v.weight", a + "v_proj.weight", (kv, H), "linear", i))
        if s.qkv_bias:
            for x, n in (("q", q), ("k", kv), ("v", kv)):
                out.append(TensorSpec(g + f"attn_{x}.bias", a + f"{x}_proj.bias", (n,), "bias", i))
        out.append(TensorSpec(g + "attn_output.weight", a + "o_proj.weight", (H, q), "linear", i))
        out.append(TensorSpec(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", (H,),
                              "norm", i))
        out.append(TensorSpec(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (I, H), "linear", i))
        out.append(TensorSpec(g + "ffn_up.weight", h + "mlp.up_proj.weight", (I, H), "linear", i))
        out.append(TensorSpec(g + "ffn_down.weight", h + "mlp.down_proj.weight", (H, I), "linear", i))
    out.append(TensorSpec("output_norm.weight", "model.norm.weight", (H,), "norm"))
    if not s.tied:
        out.append(TensorSpec("output.weight", "lm_head.weight", (V, H), "linear"))
    return out


def llama3_rope_factors(s: ModelShape) -> list[float]:
    """rope_freqs.weight as llama.cpp's converter computes it for rope_type llama3: per
    rotary frequency, the divisor of its inverse frequency (1 for high frequencies,
    ``factor`` for low ones, a smooth blend between; [head_dim / 2])."""
    rs = s.rope_scaling or {}
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for i in range(0, s.head_dim, 2):
        freq = 1.0 / (s.rope_theta ** (i / s.head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return out


def hf_config(s: ModelShape, dtype: str = "bfloat16") -> dict:
    """The HF config.json of the shape (SmolLM2's special token ids)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}[s.model_type]
    cfg = {
        "architectures": [arch], "model_type": s.model_type, "hidden_act": "silu",
        "hidden_size": s.hidden, "intermediate_size": s.ffn, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "max_position_embeddings": s.context,
        "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "rope_scaling": s.rope_scaling,
        "tie_word_embeddings": s.tied, "vocab_size": s.vocab, "torch_dtype": dtype,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if s.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    cfg.update(s.extra_config)
    return cfg
