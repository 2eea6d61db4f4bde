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


class _Runner:
    """What warm_buckets reads of a ModelRunner; records the forwards' token counts."""

    def __init__(self, config: SimpleNamespace, choices: dict[str, tuple[str, ...]]) -> None:
        import torch

        self.loaded = SimpleNamespace(hf_config=config)
        self.linear_plan = SimpleNamespace(choices=choices)
        self.num_blocks, self.block_size, self.max_model_len = 1024, 16, 8192
        self.max_batched_tokens, self.device = 512, torch.device("cpu")
        self.kv_caches: list = []
        self.forwards: list[tuple[int, int]] = []  # (tokens, start position)
        self.model = SimpleNamespace(forward=lambda ids, pos, *a: self.forwards.append(
            (len(ids), int(pos[0]))))

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def prepare_inputs(self, out):
        import torch

        seq = out.sequences[0]
        n = len(seq.token_ids)
        return torch.zeros(n), torch.arange(seq.num_computed_tokens,
                                            seq.num_computed_tokens + n), None, None


@pytest.mark.parametrize("config, bf16, forwards", [
    (_config(9, 3, 576, 1536, 30), False, [(16, 0), (512, 0), (512, 512)]),  # 135M: all
    (_config(32, 8, 2048, 8192, 16), False, [(16, 0)]),   # 1B: 16 rows within the budget
    (_config(24, 8, 3072, 8192, 28), False, []),          # 3B: neither pays for itself
    (_config(32, 8, 4096, 14336, 32), False, []),         # 8B
    (_config(32, 8, 4096, 14336, 32), True, [(16, 0), (512, 0), (512, 512)]),  # bf16: all
])
def test_warm_buckets_leaves_out_warm_ups_beyond_their_budget_without_bf16(
        config, bf16, forwards) -> None:
    from service.worker.warmup import warm_buckets

    runner = _Runner(config, {"qkv": ("cpp-q4_kx16-avx2", "bf16" if bf16 else "cpp-f32")})
    warm_buckets(runner)  # type: ignore[arg-type]
    assert runner.forwards == forwards
