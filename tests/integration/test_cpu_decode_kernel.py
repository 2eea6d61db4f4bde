"""The real model with the C++ decode attention kernel: same greedy tokens as the torch SDPA
path, and the start-up choice (auto falls back to SDPA when the kernel cannot be built; an
explicit "cpp" refuses to start)."""

from __future__ import annotations

import logging

import pytest

from kernels import decode_attention_cpu as dac
from kernels.cpu_build import KernelLibrary
from service.engine.llm import LLM

from tests.integration.greedy_prompts import GREEDY_PROMPTS


@pytest.mark.skipif(not dac.kernel_available(), reason="C++ kernel does not build here")
def test_cpp_greedy_equals_sdpa(loaded_model, tokenizer):
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS[:6]]
    sdpa = LLM(cpu_decode_kernel="sdpa", loaded=loaded_model, num_kv_blocks=64,
               max_num_batched_tokens=16)
    cpp = LLM(cpu_decode_kernel="cpp", loaded=loaded_model, num_kv_blocks=64,
              max_num_batched_tokens=16)
    assert (sdpa.runner.decode_kernel, cpp.runner.decode_kernel) == ("sdpa", "cpp")
    assert LLM(loaded=loaded_model, num_kv_blocks=8).runner.decode_kernel == "cpp"  # auto
    # a 16-token budget mixes prefill chunks (SDPA) with decodes (the kernel) in one step
    assert cpp.generate_greedy(prompts, max_tokens=12) == sdpa.generate_greedy(prompts,
                                                                               max_tokens=12)


def test_build_failure_auto_falls_back_cpp_refuses(loaded_model, monkeypatch, caplog):
    failed = KernelLibrary(dac.LIBRARY.kernel, lambda lib: None)
    failed.reset(dac.KernelBuildError("C++ compiler 'g++' not found"))
    monkeypatch.setattr(dac, "LIBRARY", failed)
    with caplog.at_level(logging.WARNING):
        llm = LLM(loaded=loaded_model, num_kv_blocks=8)
    assert llm.runner.decode_kernel == "sdpa"
    assert "not found" in caplog.text
    with pytest.raises(ValueError, match="cpu_decode_kernel 'cpp'.*cannot be used.*not found"):
        LLM(cpu_decode_kernel="cpp", loaded=loaded_model, num_kv_blocks=8)


def test_cpp_refused_for_a_dtype_it_lacks(loaded_model):
    with pytest.raises(ValueError, match="cpu_decode_kernel 'cpp'.*cannot be used.*not covered"):
        LLM(cpu_decode_kernel="cpp", dtype="bfloat16", loaded=loaded_model, num_kv_blocks=8)
