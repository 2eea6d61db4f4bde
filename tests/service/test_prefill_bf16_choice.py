"""When prefill chunks' C++ attention multiplies in bf16 (service.worker.decode_kernel's
choose_prefill_bf16_dot): the C++ plan, a mode that is not the fp32 oracle, not batch
invariance, and the kernel's run check."""

from __future__ import annotations

import pytest

from kernels import prefill_attention_cpu as pac
from service.worker.decode_kernel import choose_prefill_bf16_dot


@pytest.mark.parametrize("available", [True, False])
def test_only_cpp_quantized_not_invariant_and_where_the_cpu_has_it(monkeypatch, available):
    monkeypatch.setattr(pac, "bf16_dot_available", lambda: available)
    assert choose_prefill_bf16_dot("cpp", "auto", False) is available
    assert choose_prefill_bf16_dot("cpp", "int8", False) is available
    assert not choose_prefill_bf16_dot("cpp", None, False)  # --quantization none: the oracle
    assert not choose_prefill_bf16_dot("cpp", "auto", True)  # --batch-invariant
    assert not choose_prefill_bf16_dot("sdpa", "auto", False)
    assert not choose_prefill_bf16_dot("none", "auto", False)  # the Triton backend
