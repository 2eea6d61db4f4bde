"""silu_and_mul (Triton) against the torch reference and its definition."""

from __future__ import annotations

import pytest
import torch

from kernels import silu_and_mul, silu_and_mul_ref


def test_ref_matches_definition() -> None:
    x = torch.randn(4, 10, dtype=torch.float64)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [12, 1500])  # 1500: more than one column block
def test_triton_matches_ref(device, tolerance, dtype, inter) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn((3, 2 * inter), generator=gen) * 4).to(device, dtype)
    out = silu_and_mul(x)
    assert out.shape == (3, inter) and out.dtype == dtype
    tol = tolerance[dtype]
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", [silu_and_mul, silu_and_mul_ref])
def test_bad_shape_raises_value_error(device, impl) -> None:
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        impl(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        impl(torch.randn(8, device=device))
