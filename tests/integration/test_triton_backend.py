"""The real model through the Triton kernels (interpreted on CPU) equals the torch path."""

from __future__ import annotations

import pytest

from service.engine.llm import LLM


def test_triton_backend_greedy_equals_torch(loaded_model, tokenizer):
    pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without a GPU
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode("def add(a, b):")]
    torch_out = LLM(attention_backend="torch", loaded=loaded_model, num_kv_blocks=32,
                    max_num_batched_tokens=8).generate_greedy(prompts, max_tokens=4)
    triton_llm = LLM(attention_backend="triton", loaded=loaded_model, num_kv_blocks=32,
                     max_num_batched_tokens=8)
    assert triton_llm.runner.ops.name == "triton"
    # a budget of 8 tokens makes steps that mix prefill chunks and decodes
    assert triton_llm.generate_greedy(prompts, max_tokens=4) == torch_out
