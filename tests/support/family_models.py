"""Small random checkpoints of every model family the README claims, for oracle tests.

``write_family(name, folder)`` writes an HF folder (config.json + model.safetensors through
transformers' ``save_pretrained``, SmolLM2-135M-Instruct's tokenizer files beside) of one of
``FAMILIES``; ``write_family_gguf(name, path)`` writes a GGUF file of one of ``GGUF_FAMILIES``
through ``scripts/make_models``' writer (random blocks from a seeded generator). Both are
seeded: the same name gives the same bytes.

Values are scaled so that greedy decoding is decided by wide margins: the LM head's logits
have a standard deviation of about 12 (HF, untied) or 16 (GGUF), so the gap between the two
best tokens is rarely below 1e-2 while fp32 summation order moves logits by about 1e-5. The
tests measure the gap along every greedy path (``greedy_margin``) and refuse a checkpoint
whose gap is too narrow to decide, rather than blame the server for a coin toss.

Sliding windows (transformers' semantics, ``masking_utils.sliding_window_overlay``): a query
at position q sees keys k with q - W < k <= q (W keys, itself included). Mistral: every layer
when ``sliding_window`` is set. Qwen2: only with ``use_sliding_window: true``, and then only
the layers i >= ``max_window_layers`` (``Qwen2Config.layer_types``); the others see all keys.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 49152
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

_BASE = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
             bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")

FAMILIES: dict[str, dict] = {
    "llama3-tied": dict(model_type="llama", tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING),
    "llama3-untied": dict(model_type="llama", tie_word_embeddings=False,
                          rope_scaling=LLAMA3_SCALING),
    "llama-attention-bias": dict(model_type="llama", tie_word_embeddings=False,
                                 attention_bias=True),
    "llama-mlp-bias": dict(model_type="llama", tie_word_embeddings=False, mlp_bias=True),
    "llama-head-dim": dict(model_type="llama", tie_word_embeddings=False, head_dim=32),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen2-sliding-16": dict(model_type="qwen2", tie_word_embeddings=False, rms_norm_eps=1e-6,
                             use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "mistral-window-wide": dict(model_type="mistral", tie_word_embeddings=False,
                                sliding_window=4096),
    "mistral-sliding-16": dict(model_type="mistral", tie_word_embeddings=False,
                               sliding_window=16),
}
"""name -> config fields over ``_BASE`` (hidden 64, 2 layers, 4 / 2 heads, FFN 128,
SmolLM2's 49,152-token vocabulary, 256 positions)."""

WINDOWS = {"qwen2-sliding-16": 16, "mistral-sliding-16": 16}
"""The families whose sliding window is shorter than their context."""


def config_of(name: str):
    """The transformers config of family `name` (its model type's class)."""
    from transformers import AutoConfig

    fields = {**_BASE, **FAMILIES[name]}
    model_type = fields.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **fields)
    if model_type == "qwen2" and fields.get("use_sliding_window"):
        # transformers' rule: layers i >= max_window_layers use the window
        assert cfg.layer_types == ["full_attention", "sliding_attention"], cfg.layer_types
    return cfg


@torch.no_grad()
def _scale_weights(model, generator: torch.Generator) -> None:
    """Redraw every parameter: linears N(0, 1/fan_in), but v_proj and o_proj twice that
    std (the context, not the current token, steers the next one); biases N(0, 0.5^2);
    embeddings N(0, 1); norms 1 + N(0, 0.1^2); an untied LM head N(0, 1.5^2) (logit std
    about 1.5 sqrt(64) = 12)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=generator))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=generator))
        elif name == "lm_head.weight":
            p.copy_(1.5 * torch.randn(p.shape, generator=generator))
        else:
            gain = 2.0 if ("v_proj" in name or "o_proj" in name) else 1.0
            p.copy_(gain * torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
    if model.config.tie_word_embeddings:
        model.tie_weights()


_TOKENIZER_DIR: Path | None = None


def tokenizer_files(cache: Path) -> Path:
    """A folder with SmolLM2-135M-Instruct's tokenizer as HF files, made once per process
    (its GGUF's tokenizer takes seconds to parse)."""
    global _TOKENIZER_DIR
    if _TOKENIZER_DIR is None or not _TOKENIZER_DIR.is_dir():
        from service.bench.hf_model import save_tokenizer
        from service.worker.loader import default_model_path

        folder = cache / "smollm2-tokenizer"
        save_tokenizer(folder, default_model_path())
        _TOKENIZER_DIR = folder
    return _TOKENIZER_DIR


def write_family(name: str, folder: Path, seed: int = 0) -> Path:
    """Write family `name`'s checkpoint into `folder` (an HF folder); returns it."""
    from transformers import AutoModelForCausalLM

    cfg = config_of(name)
    gen = torch.Generator().manual_seed(seed * 1000 + sorted(FAMILIES).index(name))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale_weights(model, gen)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for f in tokenizer_files(folder.parent).iterdir():
        shutil.copy(f, folder / f.name)
    return folder


GGUF_FAMILIES: dict[str, tuple[str, str]] = {
    "llama-gguf-Q4_K_M": ("llama", "Q4_K_M"),   # Q4_K, Q6_K (attn_v, ffn_down of layer 1; output)
    "llama-gguf-Q5_K_M": ("llama", "Q5_K_M"),   # Q5_K, Q6_K as Q4_K_M's
    "llama-gguf-Q4_0": ("llama", "Q4_0"),       # Q4_0, Q6_K output
    "qwen2-gguf-Q8_0": ("qwen2", "Q8_0"),       # Q8_0 everywhere, F32 qkv biases
}
"""name -> (architecture, file type) of the GGUF checkpoints: hidden 256, so every row is
whole K-quant blocks of 256."""


def gguf_shape(arch: str):
    from service.bench.model_shapes import ModelShape

    return ModelShape(f"tiny-{arch}", arch, arch, hidden=256, layers=2, heads=4, kv_heads=2,
                      head_dim=64, ffn=512, tied=False, rope_theta=10000.0,
                      rms_eps=1e-5 if arch == "llama" else 1e-6, context=256,
                      qkv_bias=arch == "qwen2")


def write_family_gguf(name: str, path: Path, seed: int = 0) -> Path:
    """Write the GGUF checkpoint `name` at `path` (values from a seeded generator)."""
    from service.bench.gguf_writer import default_std, write_gguf
    from service.bench.gguf_types import FILE_TYPES
    from service.worker.loader import default_model_path

    arch, ftype = GGUF_FAMILIES[name]

    def std_of(spec):
        # the LM head wide (logit std about 16), biases large enough to matter
        if spec.gguf_name == "output.weight":
            return 1.0
        return 0.5 if spec.kind == "bias" else default_std(spec)

    write_gguf(path, gguf_shape(arch), FILE_TYPES[ftype], seed=seed + 1,
               tokenizer_gguf=default_model_path(), name=name, std_of=std_of)
    return path


def greedy_margin(logits: torch.Tensor) -> float:
    """The smallest gap between the best and the second-best logit over rows [N, V]."""
    top2 = logits.float().topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())
