"""service.worker.sliding_window: which configs attend within a window, and the cap."""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, Qwen2Config

from service.worker.loader import model_name
from service.worker.sliding_window import context_limit, sliding_window


def test_windows_of_each_family() -> None:
    assert sliding_window(LlamaConfig()) is None
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(Qwen2Config(sliding_window=16)) is None  # use_sliding_window off
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=16,
                                      max_window_layers=1, num_hidden_layers=3)) == 16
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=16,
                                      max_window_layers=3, num_hidden_layers=3)) is None


def test_the_context_is_capped_to_a_shorter_window_only() -> None:
    assert context_limit(MistralConfig(sliding_window=64), 32768)[0] == 64
    assert "sliding window of 64" in context_limit(MistralConfig(sliding_window=64), 32768)[1]
    assert context_limit(MistralConfig(sliding_window=65536), 32768) == (32768, None)
    assert context_limit(LlamaConfig(), 8192) == (8192, None)


def test_model_names_keep_their_own_dots() -> None:
    assert model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name("/m/Meta-Llama-3.1-8B-Instruct.Q4_K_M.gguf") == "Meta-Llama-3.1-8B-Instruct"
    assert model_name("/m/llama-3.1-8b-random-Q4_K_M.gguf") == "llama-3.1-8b-random-Q4_K_M"
    assert model_name("/m/mistral-7b-v0.3.F16.gguf") == "mistral-7b-v0.3"
    assert model_name("/m/Qwen2.5-7B-Instruct/") == "Qwen2.5-7B-Instruct"
