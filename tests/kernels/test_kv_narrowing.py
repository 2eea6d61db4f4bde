"""The fused forward's K/V store into a 16-bit cache (kernels/csrc/half.h) rounds as torch's
``.to(dtype)`` does, bit for bit, so fused and unfused steps store the same rows."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_forward_cpu as dfc

pytestmark = pytest.mark.skipif(dfc.build_problem() is not None,
                                reason=f"fused forward library unavailable: {dfc.build_problem()}")


def _edge_values() -> torch.Tensor:
    bits = torch.tensor([
        0x00000000, 0x80000000,  # +-0
        0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bf16 ties, both ways
        0x3F801000, 0x3F803000,  # fp16 ties (2^-11 and 3 * 2^-11 above 1)
        0x7F7FFFFF, 0xFF7FFFFF,  # fp32 max: bf16 rounds it to inf, fp16 overflows
        0x7F800000, 0xFF800000,  # +-inf
        0x00000001, 0x00400000, 0x807FFFFF,  # fp32 denormals
        0x33800000, 0x33000000, 0x387FC000,  # fp16 denormal range and its ties
        0x477FF000, 0x477FEFFF, 0x47800000,  # around fp16's max (65504)
    ], dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])  # the 8-wide loop and its tail
def test_random_rows_round_as_torch(dtype, n) -> None:
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-8, 4, n)
    assert torch.equal(dfc.narrow_kv(x, dtype).view(torch.int16), x.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_edge_values_round_as_torch(dtype) -> None:
    edges = _edge_values()
    for x in (edges, edges.repeat(3)[:-1]):  # in the vector loop and in the scalar tail
        got, want = dfc.narrow_kv(x.contiguous(), dtype), x.to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
            [hex(v) for v in got.view(torch.int16).tolist()],
            [hex(v) for v in want.view(torch.int16).tolist()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nan_stays_nan(dtype) -> None:
    x = torch.tensor([float("nan"), 1.0, -float("nan")] * 4)
    got = dfc.narrow_kv(x, dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(x)) and float(got[1]) == 1.0


def test_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        dfc.narrow_kv(torch.zeros(4), torch.float32)
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        dfc.narrow_kv(torch.zeros(4, 2), torch.bfloat16)
