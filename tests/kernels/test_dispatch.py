"""select_ops: backend choice and its errors, the torch backend's ops against the references;
kernels importable without triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import AttentionLayout, KernelOps, select_ops
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


def test_torch_backend_fp32_is_the_cpp_row_ops_and_other_dtypes_the_references(
        monkeypatch) -> None:
    from kernels import rowwise_cpu, torch_ops

    ops = select_ops("torch", torch.device("cpu"))
    assert isinstance(ops, KernelOps) and ops.name == "torch"
    assert ops.rms_norm is rowwise_cpu.rms_norm
    assert ops.rotary_qkv is rowwise_cpu.rotary_qkv
    assert ops.attention is torch_ops.attention_cpu
    half = select_ops("torch", torch.device("cpu"),
                      AttentionLayout(2, 1, 16, dtype=torch.bfloat16))
    assert half.rms_norm is kernels.rms_norm_ref
    assert half.fused_add_rms_norm is kernels.fused_add_rms_norm_ref
    assert half.silu_and_mul is kernels.silu_and_mul_ref
    # without the C++ library (no compiler) float32 falls back to the fused torch calls
    monkeypatch.setattr(rowwise_cpu, "build_problem", lambda: "no compiler")
    assert select_ops("torch", torch.device("cpu")).rms_norm is torch_ops.rms_norm_f32


@pytest.mark.parametrize("variant", ["float32", "float32-torch", "bfloat16"])
def test_torch_backend_ops_match_the_references(variant, monkeypatch) -> None:
    """The float32 ops are the references' math: the C++ row ops up to float rounding, the
    fused torch calls (no C++ build) with RMSNorm bit for bit."""
    from kernels import rowwise_cpu

    torch.manual_seed(0)
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    if variant == "float32-torch":
        monkeypatch.setattr(rowwise_cpu, "build_problem", lambda: "no compiler")
    T, Hq, Hkv, D = 5, 4, 2, 16
    ops = select_ops("torch", "cpu", AttentionLayout(Hq, Hkv, D, dtype=dtype))
    assert (ops.rms_norm is rowwise_cpu.rms_norm) == (variant == "float32")
    x, r, w = (torch.randn(T, 32, dtype=dtype) for _ in range(3))
    w = w[0]
    if variant == "float32":
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), kernels.rms_norm_ref(x, w, 1e-5))
    else:
        assert torch.equal(ops.rms_norm(x, w, 1e-5), kernels.rms_norm_ref(x, w, 1e-5))
    got = ops.fused_add_rms_norm(x.clone(), r, w, 1e-5)
    want = kernels.fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(ops.silu_and_mul(x), kernels.silu_and_mul_ref(x))
    cos_t, sin_t = torch.randn(10, D // 2, dtype=dtype), torch.randn(10, D // 2, dtype=dtype)
    pos = torch.tensor([0, 3, 3, 9, 1])
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q, k, v = ops.rotary_qkv(qkv.clone(), *ops.rotary_tables(cos_t, sin_t, pos), Hq, Hkv, D)
    q_ref, k_ref = kernels.rotary_embedding_ref(qkv[:, :Hq * D].view(T, Hq, D),
                                                qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
                                                cos_t[pos], sin_t[pos])
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(v, qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D))


def test_auto_backend_picks_by_device() -> None:
    assert select_ops("auto", torch.device("cpu")).name == "torch"
    assert select_ops("auto", torch.device("cuda")).name == "triton"


def test_triton_backend_returns_kernels(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = select_ops("triton", torch.device("cpu"))
    assert ops.name == "triton"
    assert ops.rms_norm is kernels.rms_norm
    assert ops.fused_add_rms_norm is kernels.fused_add_rms_norm
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
