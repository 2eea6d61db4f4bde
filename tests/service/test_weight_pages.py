"""service.worker.weight_pages: the decode buckets' packed weights moved into one huge-page
arena, a split weight's parts included, every path that reads a tensor switched to the copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from kernels.gguf_pack import pack_gguf
from kernels.packed_parts import PackedParts, per_part
from kernels.quant_pack import with_int16_activations
from service.worker.quantization.paths import CppLinear
from service.worker.quantization.plan import DispatchLinear
from service.worker.weight_pages import packed_weights_on_huge_pages
from tests.kernels.test_gguf_pack import random_raw


@pytest.mark.skipif(not qlc.available_isas(), reason="no C++ build of the linear kernel here")
def test_a_split_weights_parts_move_and_every_reader_follows() -> None:
    isa = qlc.available_isas()[0]
    split = PackedParts((pack_gguf([("Q4_K", random_raw("Q4_K", 96, 256, seed=1))]),
                         pack_gguf([("Q6_K", random_raw("Q6_K", 32, 256, seed=2))])))
    decode, prefill = CppLinear(split, isa), CppLinear(per_part(with_int16_activations, split), isa)
    lin = DispatchLinear([decode, decode, prefill, prefill], ("a", "a", "b", "b"), 256, 128)
    x1, x64 = torch.randn(1, 256), torch.randn(64, 256)
    want1, want64 = lin(x1), lin(x64)
    before = [p.data.data_ptr() for p in split.parts]
    moved = packed_weights_on_huge_pages(SimpleNamespace(linears=lambda: [lin]))
    assert moved >= split.nbytes - 64  # every tensor of both parts (sizes rounded up)
    assert isinstance(decode.packed, PackedParts) and isinstance(prefill.packed, PackedParts)
    for a, b, old in zip(decode.packed.parts, prefill.packed.parts, before):
        assert a.data is b.data and a.super_scale is b.super_scale  # one copy, both read it
        assert a.data.data_ptr() != old  # the arena's copy (advised to huge pages from 2 MiB)
    assert torch.equal(lin(x1), want1) and torch.equal(lin(x64), want64)
