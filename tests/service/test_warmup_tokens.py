"""service.worker.warmup.warmup_tokens: the start-up prefill steps shrink with the
model (128 tokens at the 8B shape took minutes on 2 cores), never below one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.worker.warmup import WARMUP_MACS, warmup_tokens


def _config(heads: int, kv: int, hidden: int, ffn: int, layers: int, **kw) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden,
                           intermediate_size=ffn, num_hidden_layers=layers, **kw)


@pytest.mark.parametrize("config, tokens", [
    (_config(9, 3, 576, 1536, 30), 128),        # SmolLM2-135M
    (_config(32, 8, 2048, 8192, 16), 16),       # Llama-3.2-1B
    (_config(24, 8, 3072, 8192, 28), 5),        # Llama-3.2-3B
    (_config(32, 8, 4096, 14336, 32), 2),       # Llama-3.1-8B
    (_config(28, 4, 3584, 18944, 28), 2),       # Qwen2.5-7B
])
def test_tokens_per_model_size(config, tokens) -> None:
    assert warmup_tokens(config) == tokens


def test_the_budget_and_an_explicit_head_dim() -> None:
    tiny = _config(4, 4, 64, 128, 2)
    assert warmup_tokens(tiny) == 128  # capped
    # head_dim given (not hidden / heads): the attention projections are counted with it
    wide = _config(8, 8, 256, 256, 4, head_dim=256)
    per_token = 4 * (256 * 256 * 32 + 3 * 256 * 256)
    assert warmup_tokens(wide) == min(128, WARMUP_MACS // per_token // 16 * 16)
    assert warmup_tokens(_config(64, 8, 16384, 53248, 126)) == 1  # 405B: one token
