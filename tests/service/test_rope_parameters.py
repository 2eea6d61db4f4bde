"""The loader's rope parameters (read from transformers' ``modeling_rope_utils``, without
importing the modeling modules) equal the families' own rotary embedding modules', for every
rope type served, and a rope type outside them is refused by name."""

from __future__ import annotations

import pytest
import torch

from service.worker.loader import ROPE_TYPES, rope_parameters

ROPE_SCALING = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
}


def _family(name: str):
    import transformers
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    return {"llama": (transformers.LlamaConfig, modeling_llama.LlamaRotaryEmbedding),
            "mistral": (transformers.MistralConfig, modeling_mistral.MistralRotaryEmbedding),
            "qwen2": (transformers.Qwen2Config, modeling_qwen2.Qwen2RotaryEmbedding)}[name]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@pytest.mark.parametrize("head_dim", [None, 96])
def test_rope_parameters_equal_the_familys_rotary_module(family, rope_type, head_dim) -> None:
    config_cls, module_cls = _family(family)
    kw = {"head_dim": head_dim} if head_dim else {}
    config = config_cls(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                        rope_theta=500000.0, max_position_embeddings=131072,
                        rope_scaling=ROPE_SCALING[rope_type], **kw)
    module = module_cls(config)
    got_type, inv_freq, scaling = rope_parameters(config)
    assert got_type == module.rope_type == rope_type
    assert inv_freq.dtype == torch.float32
    assert inv_freq.shape == ((head_dim or 64) // 2,)
    torch.testing.assert_close(inv_freq, module.inv_freq.float(), rtol=0, atol=0)
    assert scaling == float(module.attention_scaling)


def test_a_rope_type_not_served_is_refused_by_name() -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' is not supported.*llama3"):
        rope_parameters(config)
