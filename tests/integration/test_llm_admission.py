"""`LLM` admits through the Engine's Admission, on the real model: a request larger
than the whole KV pool is refused at once (it used to wait forever in the scheduler)."""

from __future__ import annotations

import time

import pytest

from protocol import ContextLengthExceeded
from service.engine.llm import LLM

pytestmark = pytest.mark.model


def test_a_prompt_larger_than_the_kv_pool_raises_at_once(loaded_model):
    llm = LLM(loaded=loaded_model, num_kv_blocks=4)  # 4 blocks of 16 tokens: 64 tokens
    prompt = llm.runner.tokenizer("word " * 300, add_special_tokens=False)["input_ids"][:300]
    assert len(prompt) == 300
    t0 = time.monotonic()
    with pytest.raises(ContextLengthExceeded, match="KV blocks") as e:
        llm.generate([prompt], {"max_tokens": 4})
    assert time.monotonic() - t0 < 2 and e.value.param == "$.params.max_tokens"
    assert "19 KV blocks (304 tokens)" in str(e.value)  # in tokens too, and what sizes it
    assert "the whole cache has 4 (64 tokens" in str(e.value)
    assert "--kv-cache-memory" in str(e.value)
    assert len(llm.generate_greedy([prompt[:40]], max_tokens=4)[0]) <= 4
