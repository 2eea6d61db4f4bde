"""The context served when the KV cache holds less than the model's: with both left to their
defaults the runner serves (and the engine advertises) what the cache holds; a context or a
block count that was set is served as set."""

from __future__ import annotations

import pytest

from service.config import CacheConfig, EngineConfig, ModelConfig
from service.worker.model_runner import ModelRunner

pytestmark = pytest.mark.model

SMALL_KV = 64 << 20
"""64 MiB: about 1,450 tokens of SmolLM2-135M's fp32 cache, below its 8,192-token context."""


def _runner(loaded_model, **cache) -> ModelRunner:
    max_model_len = cache.pop("max_model_len", None)
    return ModelRunner(EngineConfig(
        model=ModelConfig(quantization=None, max_model_len=max_model_len),
        cache=CacheConfig(swap_space=0.01, **cache)), loaded_model)


def test_default_context_is_what_the_kv_cache_holds(loaded_model) -> None:
    runner = _runner(loaded_model, kv_cache_memory=SMALL_KV)
    held = runner.num_blocks * runner.block_size
    assert held < loaded_model.hf_config.max_position_embeddings
    assert runner.max_model_len == held


def test_a_context_or_block_count_that_was_set_is_served_as_set(loaded_model) -> None:
    assert _runner(loaded_model, kv_cache_memory=SMALL_KV,
                   max_model_len=4096).max_model_len == 4096
    model_len = loaded_model.hf_config.max_position_embeddings
    assert _runner(loaded_model, num_kv_blocks=8).max_model_len == model_len


def test_a_roomy_cache_keeps_the_model_context(loaded_model) -> None:
    runner = _runner(loaded_model, kv_cache_memory=1 << 30)
    assert runner.num_blocks * runner.block_size > runner.max_model_len
    assert runner.max_model_len == loaded_model.hf_config.max_position_embeddings
