"""A Llama 3 GGUF file's rope scaling, kept by llama.cpp's converter only as the
``rope_freqs.weight`` tensor, is applied by our loader (transformers' GGUF loader drops it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("gguf")

from service.bench.gguf_types import FILE_TYPES  # noqa: E402
from service.bench.gguf_writer import write_gguf  # noqa: E402
from service.bench.model_shapes import SHAPES  # noqa: E402
from service.worker.loader import default_model_path, load_model  # noqa: E402


def test_llama3_rope_factors_give_transformers_llama3_frequencies(tmp_path) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    real = SHAPES["llama-3.2-1b"]  # its rope: theta 500000, llama3 factor 32, head_dim 64
    tiny = dataclasses.replace(real, name="tiny-llama3", hidden=256, layers=1, heads=4,
                               kv_heads=2, ffn=256)
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(path, tiny, FILE_TYPES["Q8_0"], seed=0, tokenizer_gguf=default_model_path(),
               name="tiny-llama3")
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                      rope_theta=real.rope_theta, rope_scaling=dict(real.rope_scaling),
                      max_position_embeddings=real.context)
    want = LlamaRotaryEmbedding(cfg).inv_freq.float()
    unscaled = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=real.rope_theta,
        max_position_embeddings=real.context)).inv_freq.float()
    assert (unscaled - want).abs().max() > 1e-4  # what transformers' GGUF loader serves
    for blocks in (True, False):
        got = load_model(str(path), torch.float32, blocks=blocks).inv_freq
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
