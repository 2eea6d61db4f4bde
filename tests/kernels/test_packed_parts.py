"""kernels.packed_parts: a fused weight whose parts' GGUF blocks differ (Q4_K_M's qkv) served
as its parts, each in its own format: which runs ``split_runs`` makes, and the linear kernel
over a split giving each part's own output bits in its columns, on every build, with fp32 and
int16 activations."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from kernels.gguf_pack import dequantize_gguf, pack_gguf, split_runs
from kernels.packed_parts import PackedParts, per_part, unpack_any
from kernels.quant_pack import pack_f32, with_int16_activations
from tests.kernels.test_gguf_pack import random_raw


@pytest.mark.parametrize("types, runs", [
    (("Q4_K", "Q4_K", "Q6_K"), [("q4_k", [0, 1]), ("q6_k", [2])]),   # Q4_K_M's qkv
    (("Q5_K", "Q5_K", "Q6_K"), [("q5_k", [0, 1]), ("q6_k", [2])]),   # Q5_K_M's
    (("Q3_K", "Q3_K", "Q5_K"), [("i8_k", [0, 1]), ("q5_k", [2])]),   # Q3_K_M's
    (("Q6_K", "Q4_K", "Q4_K"), [("q6_k", [0]), ("q4_k", [1, 2])]),
    (("Q4_0", "Q4_1", "Q8_0"), [("q4_0", [0]), ("q4_1", [1]), ("q8_0", [2])]),
    (("Q4_1", "Q4_1", "Q8_0"), [("q4_1", [0, 1]), ("q8_0", [2])]),
    (("Q4_K", "Q4_K", "Q4_K"), None),                                # one format: not split
    (("Q2_K", "Q3_K"), None),                                        # i8_k both
    (("Q4_K", "F16"), None),                                         # a float part
    (("Q4_K", "IQ2_XS"), None),                                      # no format of ours
])
def test_runs_of_parts_in_one_format(types, runs) -> None:
    assert split_runs(types) == runs


def _split(bias: bool = True) -> tuple[PackedParts, torch.Tensor, torch.Tensor | None]:
    """A q4_k [q, k] + q6_k [v] split of 3 parts (160 + 64 + 64 rows, K 512): the packed
    split, its dequantized weight [288, 512] and its bias."""
    raws = [("Q4_K", random_raw("Q4_K", 160, 512, seed=1)),
            ("Q4_K", random_raw("Q4_K", 64, 512, seed=2)),
            ("Q6_K", random_raw("Q6_K", 64, 512, seed=3))]
    b = torch.randn(288) if bias else None
    split = PackedParts((pack_gguf(raws[:2], None if b is None else b[:224]),
                         pack_gguf(raws[2:], None if b is None else b[224:])))
    w = torch.cat([dequantize_gguf(t, r) for t, r in raws])
    return split, w, b


def test_a_split_is_its_parts_rows_in_order() -> None:
    split, w, b = _split()
    assert split.fmt == "split" and [p.fmt for p in split.parts] == ["q4_k", "q6_k"]
    assert (split.out_features, split.in_features) == (288, 512)
    assert torch.equal(unpack_any(split), w) and torch.equal(split.bias, b)
    assert split.nbytes == sum(p.nbytes for p in split.parts)
    x16 = per_part(with_int16_activations, split)
    assert x16.fmt == "splitx16" and [p.fmt for p in x16.parts] == ["q4_kx16", "q6_kx16"]
    assert all(a.data is c.data for a, c in zip(x16.parts, split.parts))  # shared tensors
    assert _split(bias=False)[0].bias is None
    with pytest.raises(ValueError, match="at least two parts"):
        PackedParts(split.parts[:1])
    with pytest.raises(ValueError, match="input features"):
        PackedParts((split.parts[0], pack_f32(torch.randn(8, 256))))


@pytest.mark.parametrize("isa", qlc.available_isas())
@pytest.mark.parametrize("act16", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 40])
def test_kernel_over_a_split_gives_each_parts_bits(isa, act16, rows) -> None:
    split, w, b = _split()
    if act16:
        split = per_part(with_int16_activations, split)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    y = qlc.quant_linear(x, split, isa)
    assert y.shape == (rows, 288)
    parts = [qlc.quant_linear(x, p, isa) for p in split.parts]
    assert torch.equal(y, torch.cat(parts, dim=1))  # the same bits as each part alone
    if rows:
        want = x.double() @ w.double().t() + b.double()
        err = float((y.double() - want).norm() / want.norm())
        assert err < (1e-4 if act16 else 1e-6)
    # into a row slice of a wider buffer, as the unfused forward's outputs may be
    out = torch.full((rows, 300), 7.0)
    qlc.quant_linear(x, split, isa, out[:, :288])
    assert torch.equal(out[:, :288], y) and bool((out[:, 288:] == 7.0).all())
    assert torch.equal(qlc.dequantize(split, isa), w)
