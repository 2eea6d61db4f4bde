"""The fused decode forward over q4_k / q5_k / i8_k / q6_k layers (GGUF K-quant blocks): it passes their
super-block scales to the linear kernel, so a step's logits match the same model with the
same weights as fp32 panels (up to fp32 rounding; with int16 activations, q4_kx16 / i8_kx16 /
q6_kx16 / q5_kx16, up to their rounding), on every build."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_forward_cpu as dfc
from kernels import quant_linear_cpu as qlc
from kernels.gguf_pack import pack_gguf
from kernels.packed_parts import AnyPacked, PackedParts, per_part, unpack_any
from kernels.quant_pack import pack_f32, with_int16_activations
from tests.kernels.test_gguf_pack import random_raw

pytestmark = pytest.mark.skipif(not qlc.available_isas() or dfc.build_problem() is not None,
                                reason="the fused forward needs the C++ kernels (g++)")
H, HEADS, KV_HEADS, D, INTER, VOCAB = 256, 4, 2, 64, 256, 64


def _model(packed: dict[str, AnyPacked], isa: str, g: torch.Generator) -> dfc.FusedForward:
    kv = torch.zeros(2, 4, 16, KV_HEADS, D)
    layer = dfc.FusedLayer(*[(packed[n], isa) for n in ("qkv", "o", "gate_up", "down")],
                           ln1=torch.ones(H), ln2=torch.ones(H), kv=kv)
    angles = torch.arange(32)[:, None] * 0.1 * torch.arange(1, D // 2 + 1)[None] / D
    return dfc.FusedForward([layer], (packed["lm_head"], isa),
                            torch.randn(VOCAB, H, generator=g), torch.ones(H),
                            angles.cos().contiguous(), angles.sin().contiguous(),
                            num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                            intermediate=INTER, eps=1e-5, scale=D ** -0.5)


@pytest.mark.parametrize("isa", qlc.available_isas())
@pytest.mark.parametrize("act16", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_fused_step_over_k_formats_matches_fp32_panels(isa, act16, split) -> None:
    """split: the mixed qkv as a split weight (q4_k q and k, q6_k v: kernels.packed_parts),
    which the fused forward calls part by part; else one i8_k weight."""
    parts = {"qkv": [("Q4_K", HEADS * D), ("Q4_K", KV_HEADS * D), ("Q6_K", KV_HEADS * D)],
             "o": [("Q4_K", H)], "gate_up": [("Q5_K", INTER), ("Q5_K", INTER)],
             "down": [("Q6_K", H)], "lm_head": [("Q6_K", VOCAB)]}
    k_of = {"o": HEADS * D, "down": INTER}
    raws = {name: [(t, random_raw(t, n, k_of.get(name, H), seed=i)) for i, (t, n) in enumerate(ps)]
            for name, ps in parts.items()}
    packed = {name: pack_gguf(r) for name, r in raws.items()}
    assert {p.fmt for p in packed.values()} == {"q4_k", "i8_k", "q6_k", "q5_k"}
    if split:
        packed["qkv"] = PackedParts((pack_gguf(raws["qkv"][:2]), pack_gguf(raws["qkv"][2:])))
    dense = {name: pack_f32(unpack_any(p)) for name, p in packed.items()}
    if act16:
        packed = {name: per_part(with_int16_activations, p) for name, p in packed.items()}
        assert {p.fmt for p in packed.values()} == \
            {"q4_kx16", "splitx16" if split else "i8_kx16", "q6_kx16", "q5_kx16"}
    step = (torch.tensor([3, 7]), torch.tensor([0, 0]), torch.tensor([0, 16]),
            torch.tensor([[0, 0], [1, 0]]), torch.tensor([1, 1]), torch.tensor([0, 1]))
    got = _model(packed, isa, torch.Generator().manual_seed(0))(*step)
    want = _model(dense, isa, torch.Generator().manual_seed(0))(*step)
    assert got.shape == (2, VOCAB) and bool(torch.isfinite(got).all()) and float(got.std()) > 0
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
