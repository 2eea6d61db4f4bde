"""rms_norm / fused_add_rms_norm (Triton) against their torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_ref_matches_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn((5, 24), generator=gen), torch.randn(24, generator=gen)
    expected = torch.stack([w.double() * row.double() / (row.double().pow(2).mean() + 1e-6).sqrt() for row in x])
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6).double(), expected, atol=1e-5, rtol=1e-5)
    r = torch.randn((5, 24), generator=gen)
    out, new_residual = fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(new_residual, x + r)
    torch.testing.assert_close(out, rms_norm_ref(x + r, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [24, 64])
def test_triton_rms_norm_matches_ref(device, tolerance, dtype, hidden) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn((7, hidden), generator=gen) * 3).to(device, dtype)
    w = torch.randn(hidden, generator=gen).to(device, dtype)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    tol = tolerance[dtype]
    torch.testing.assert_close(out.float(), rms_norm_ref(x, w, 1e-5).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_fused_add_matches_ref(device, tolerance, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn((6, 40), generator=gen).to(device, dtype) for _ in range(2))
    w = torch.randn(40, generator=gen).to(device, dtype)
    out, new_residual = fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, r, w, 1e-6)
    tol = tolerance[dtype]
    torch.testing.assert_close(new_residual, ref_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


def test_triton_accepts_row_strided_input(device) -> None:
    wide = torch.randn(4, 50, device=device)
    x = wide[:, 5:37]  # row stride 50
    w = torch.randn(32, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", [rms_norm, rms_norm_ref])
def test_bad_arguments_raise_value_error(device, impl) -> None:
    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        impl(x, w[:4], 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        impl(x[0], w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        impl(x, w, 0.0)


@pytest.mark.parametrize("impl", [fused_add_rms_norm, fused_add_rms_norm_ref])
def test_fused_rejects_mismatched_residual(device, impl) -> None:
    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    with pytest.raises(ValueError, match="residual"):
        impl(x, x[:2], w, 1e-6)
