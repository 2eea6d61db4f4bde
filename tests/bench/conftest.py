"""Fixtures of the benchmark tests: the model's tokenizer, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bench_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the default GGUF (~10 s, once)."""
    from service.bench.tokenizer import load_tokenizer

    return load_tokenizer(None)
