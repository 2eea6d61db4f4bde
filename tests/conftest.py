"""Shared fixtures: the real model is loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in its interpreter on a machine without a GPU. The variable must
# be set before anything imports triton (transformers may), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' own kernel builds and linear-kernel timings go to a cache of their own: timings
# taken while the suite's servers compete for the cores must never reach the cache that
# `conveyor serve` reads (once they made an idle server decode on fp32 kernels, 4x slower).
# Subprocesses (servers, benches) inherit it. A caller's CONVEYOR_CACHE_DIR wins.
os.environ.setdefault("CONVEYOR_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "tests"))


@pytest.fixture(scope="session")
def loaded_model():
    """SmolLM2-135M-Instruct (fp32, CPU) through our loader: config, tokenizer, weights."""
    from service.worker.loader import load_model

    return load_model(None, torch.float32)


@pytest.fixture(scope="session")
def served_model():
    """The same checkpoint read as the GGUF file's own blocks (no dense copy): what
    `conveyor serve` loads in the default --quantization auto."""
    from service.worker.loader import load_model

    return load_model(None, torch.float32, blocks=True)


@pytest.fixture(scope="session")
def hf_model():
    """The transformers implementation of the same checkpoint: the test oracle."""
    from transformers import AutoModelForCausalLM

    from service.worker.loader import _source, default_model_path

    folder, kw = _source(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    return loaded_model.tokenizer
