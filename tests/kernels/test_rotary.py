"""rotary_embedding (Triton) against the torch reference, and the reference
against the Hugging Face formulation (cos/sin repeated over the head dim)."""

from __future__ import annotations

import pytest
import torch

from kernels import rotary_embedding, rotary_embedding_ref


def _angles(tokens: int, half: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 500, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half).float() / half))
    freqs = positions[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos(), freqs.sin()


def test_ref_matches_hf_rotate_half() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn((5, 4, 16), generator=gen), torch.randn((5, 2, 16), generator=gen)
    cos, sin = _angles(5, 8, gen)
    cos_full, sin_full = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]  # [T, 1, D]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    q_out, k_out = rotary_embedding_ref(q, k, cos, sin)
    torch.testing.assert_close(q_out, q * cos_full + rotate_half(q) * sin_full)
    torch.testing.assert_close(k_out, k * cos_full + rotate_half(k) * sin_full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(3, 3), (6, 2)])
def test_triton_matches_ref(device, tolerance, dtype, heads) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((7, heads[0], 32), generator=gen).to(device, dtype)
    k = torch.randn((7, heads[1], 32), generator=gen).to(device, dtype)
    cos, sin = (t.to(device) for t in _angles(7, 16, gen))
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    q_ref, k_ref = rotary_embedding_ref(q, k, cos, sin)
    tol = tolerance[dtype]
    assert q_out.dtype == dtype and k_out.shape == k.shape
    torch.testing.assert_close(q_out.float(), q_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_out.float(), k_ref.float(), atol=tol, rtol=tol)


def test_triton_accepts_fused_qkv_views(device) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, hq, hkv, dim = 4, 6, 2, 16
    qkv = torch.randn((tokens, (hq + 2 * hkv) * dim), generator=gen).to(device)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    cos, sin = (t.to(device) for t in _angles(tokens, dim // 2, gen))
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    q_ref, k_ref = rotary_embedding_ref(q.contiguous(), k.contiguous(), cos, sin)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [rotary_embedding, rotary_embedding_ref])
def test_bad_arguments_raise_value_error(device, impl) -> None:
    q, k = torch.randn(3, 2, 8, device=device), torch.randn(3, 1, 8, device=device)
    cos = sin = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="cos must be"):
        impl(q, k, cos[:, :2], sin)
    with pytest.raises(ValueError, match="k must be"):
        impl(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="even"):
        impl(q[..., :7], k[..., :7], cos, sin)
