"""select_ops: backend choice and its errors; kernels importable without triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import KernelOps, select_ops
from kernels import _triton

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_run_natively_on_cuda_or_interpreted_on_cpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    jitted = _triton.jit(kernels.activation._silu_and_mul_kernel)
    if torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") != "1"
        assert not isinstance(jitted, InterpretedFunction)
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert isinstance(jitted, InterpretedFunction)


def test_torch_backend_returns_references() -> None:
    ops = select_ops("torch", torch.device("cpu"))
    assert isinstance(ops, KernelOps) and ops.name == "torch"
    assert ops.paged_attention is kernels.paged_attention_ref
    assert ops.store_kv is kernels.store_kv_ref
    assert ops.rms_norm is kernels.rms_norm_ref
    assert ops.fused_add_rms_norm is kernels.fused_add_rms_norm_ref
    assert ops.rotary_embedding is kernels.rotary_embedding_ref
    assert ops.silu_and_mul is kernels.silu_and_mul_ref


def test_auto_backend_picks_by_device() -> None:
    assert select_ops("auto", torch.device("cpu")).name == "torch"
    assert select_ops("auto", torch.device("cuda")).name == "triton"


def test_triton_backend_returns_kernels(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = select_ops("triton", torch.device("cpu"))
    assert ops.name == "triton"
    assert ops.paged_attention is kernels.paged_attention
    assert ops.store_kv is kernels.store_kv
    assert ops.silu_and_mul is kernels.silu_and_mul


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_ops("triton", torch.device("cpu"))


def test_triton_backend_without_triton(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(ValueError, match="cannot be imported"):
        select_ops("triton", torch.device("cuda"))
    assert select_ops("auto", torch.device("cuda")).name == "torch"


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_ops("flash", torch.device("cpu"))


def test_import_without_triton_keeps_references_working() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "x = torch.randn(2, 8)\n"
        "assert kernels.silu_and_mul_ref(x).shape == (2, 4)\n"
        "assert kernels.select_ops('auto', torch.device('cpu')).name == 'torch'\n"
        "try:\n"
        "    kernels.select_ops('triton', torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    assert 'cannot be imported' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no ValueError')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
