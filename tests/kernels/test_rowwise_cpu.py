"""kernels.rowwise_cpu: the unfused CPU forward's small ops in C++ against the references."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import rowwise_cpu as rw

pytestmark = pytest.mark.skipif(rw.build_problem() is not None,
                                reason=f"C++ row ops unavailable: {rw.build_problem()}")


@pytest.mark.parametrize("rows", [0, 1, 7, 64])  # 64: over the threads
def test_norms_match_the_references(rows) -> None:
    torch.manual_seed(rows)
    x, r = torch.randn(rows, 48), torch.randn(rows, 48)
    w = torch.randn(48)
    torch.testing.assert_close(rw.rms_norm(x, w, 1e-5), kernels.rms_norm_ref(x, w, 1e-5))
    fresh = x.clone()
    y, residual = rw.fused_add_rms_norm(fresh, r, w, 1e-5)
    want_y, want_residual = kernels.fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(residual, want_residual)
    assert residual.data_ptr() == fresh.data_ptr()  # the new residual is x, overwritten


def test_rows_may_be_a_strided_slice() -> None:
    """A row slice of a wider tensor (e.g. one part of a fused projection) is read in place."""
    torch.manual_seed(1)
    wide = torch.randn(9, 80)
    x = wide[:, 16:64]  # rows 80 floats apart
    w = torch.randn(48)
    torch.testing.assert_close(rw.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))
    gu = wide[:, :64]
    torch.testing.assert_close(rw.silu_and_mul(gu), kernels.silu_and_mul_ref(gu))


@pytest.mark.parametrize("rows", [1, 12])
def test_silu_and_mul_matches_the_reference(rows) -> None:
    torch.manual_seed(2)
    x = torch.randn(rows, 2 * 40) * 4
    x[0, 0], x[0, 1] = -200.0, 100.0  # exp's argument clamped, still silu's value
    # a whole vector of gates past +-87 (clamped on both sides), beside ordinary ones
    x[-1, :32] = torch.linspace(-300.0, 300.0, 32)
    torch.testing.assert_close(rw.silu_and_mul(x), kernels.silu_and_mul_ref(x))


@pytest.mark.parametrize("rows", [1, 16])
def test_rotary_qkv_rotates_q_and_k_in_place(rows) -> None:
    torch.manual_seed(3)
    Hq, Hkv, D = 6, 2, 16
    qkv = torch.randn(rows, (Hq + 2 * Hkv) * D)
    original = qkv.clone()
    cos_t, sin_t = torch.randn(40, D // 2), torch.randn(40, D // 2)
    pos = torch.randint(0, 40, (rows,))
    q, k, v = rw.rotary_qkv(qkv, *rw.rotary_tables(cos_t, sin_t, pos), Hq, Hkv, D)
    q_ref, k_ref = kernels.rotary_embedding_ref(
        original[:, :Hq * D].view(rows, Hq, D),
        original[:, Hq * D:(Hq + Hkv) * D].view(rows, Hkv, D), cos_t[pos], sin_t[pos])
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    assert torch.equal(v, original[:, (Hq + Hkv) * D:].view(rows, Hkv, D))
    assert q.data_ptr() == qkv.data_ptr()  # views of the projection, rotated in place


def test_bad_input_raises_before_any_write() -> None:
    w = torch.randn(8)
    with pytest.raises(ValueError, match="float32"):
        rw.rms_norm(torch.randn(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="unit-stride"):
        rw.rms_norm(torch.randn(8, 2).t(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        rw.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rw.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="even width"):
        rw.silu_and_mul(torch.randn(2, 7))
    qkv = torch.randn(2, 4 * 8)
    cos = torch.randn(2, 4)
    with pytest.raises(ValueError, match="columns"):
        rw.rotary_qkv(qkv, cos, cos, 3, 1, 8)
    with pytest.raises(ValueError, match="cos"):
        rw.rotary_qkv(qkv, torch.randn(3, 4), cos, 2, 1, 8)
    with pytest.raises(ValueError, match="rejected"):  # odd head dim: the kernel's check
        rw.rotary_qkv(torch.randn(2, 4 * 7), torch.randn(2, 3), torch.randn(2, 3), 2, 1, 7)
