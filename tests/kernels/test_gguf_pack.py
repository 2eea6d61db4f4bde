"""kernels.gguf_pack: a GGUF tensor's raw rows packed for our kernels serve exactly the values
gguf-py's reference dequantizes (``gguf.quants.dequantize``), bit for bit, for every type
served, alone and mixed in a fused weight; the format chosen for each mix; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.gguf_pack import BLOCK_BYTES, dequantize_gguf, gguf_format, pack_gguf
from kernels.quant_pack import unpack

FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
           "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
"""Byte offsets of each block type's fp16 fields (d, dmin / m)."""
TYPES = [*FP16_AT, "F32", "F16", "BF16"]


def random_raw(gguf_type: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row bytes] uint8: random blocks with finite, modest fp16 d / dmin (any sign)."""
    size, nbytes = BLOCK_BYTES[gguf_type]
    g = np.random.default_rng(seed)
    if gguf_type in ("F32", "F16", "BF16"):
        v = g.standard_normal((n, k)).astype(np.float16 if gguf_type == "F16" else np.float32)
        if gguf_type == "BF16":
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        return torch.from_numpy(v.view(np.uint8).reshape(n, -1).copy())
    r = g.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for off in FP16_AT[gguf_type]:
        d = (g.standard_normal((n, k // size)) * 0.01).astype(np.float16)
        r[..., off:off + 2] = d[..., None].view(np.uint8).reshape(n, k // size, 2)
    return torch.from_numpy(r.reshape(n, -1))


@pytest.mark.parametrize("gguf_type", TYPES)
def test_one_type_unpacks_to_ggufs_dequantization(gguf_type) -> None:
    raw = random_raw(gguf_type, 70, 512)
    packed = pack_gguf([(gguf_type, raw)])
    assert packed.fmt == gguf_format([gguf_type]) and packed.out_features == 70
    assert torch.equal(unpack(packed), dequantize_gguf(gguf_type, raw))


@pytest.mark.parametrize("types,fmt,size", [
    (("Q4_K", "Q4_K", "Q4_K"), "q4_k", 256), (("Q4_K", "Q4_K", "Q6_K"), "i8_k", 256),
    (("Q5_K", "Q2_K", "Q3_K"), "i8_k", 256), (("Q4_0", "Q4_1"), "q4_1", 0),
    (("Q8_0", "Q5_0"), "q8_0", 0), (("Q4_K", "Q5_1", "Q8_0", "Q4_0"), "i8_k", 32),
    (("F16", "BF16", "F32"), "f32", 0)])
def test_fused_parts_unpack_to_their_dequantizations(types, fmt, size) -> None:
    raws = [random_raw(t, 17 + 20 * i, 512, seed=i) for i, t in enumerate(types)]
    bias = torch.randn(sum(r.shape[0] for r in raws))
    packed = pack_gguf(list(zip(types, raws)), bias)
    assert (packed.fmt, packed.super_group) == (fmt, size)
    want = torch.cat([dequantize_gguf(t, r) for t, r in zip(types, raws)])
    assert torch.equal(unpack(packed), want)
    assert torch.equal(packed.bias[:want.shape[0]], bias)


def test_reordered_rows_stay_exact() -> None:
    raw = random_raw("Q4_K", 64, 256)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack(pack_gguf([("Q4_K", raw[order])])),
                       dequantize_gguf("Q4_K", raw)[order])


def test_formats_of_mixes() -> None:
    assert gguf_format(("Q4_0",)) == "q4_0"
    assert gguf_format(("Q6_K", "Q6_K")) == "q6_k" and gguf_format(("Q6_K", "Q4_K")) == "i8_k"
    assert gguf_format(("Q5_1",)) == "i8_k"
    assert gguf_format(("IQ2_XS",)) is None
    assert gguf_format(("F16", "Q8_0")) is None
    assert gguf_format(()) is None


def test_bad_input_raises_value_error() -> None:
    raw = random_raw("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="no packed format"):
        pack_gguf([("IQ2_XS", raw)])
    with pytest.raises(ValueError, match="whole blocks"):
        pack_gguf([("Q4_K", raw[:, :100])])
    with pytest.raises(ValueError, match="different input features"):
        pack_gguf([("Q4_K", raw), ("Q4_K", random_raw("Q4_K", 4, 512))])
    with pytest.raises(ValueError, match="uint8"):
        pack_gguf([("Q4_K", raw.float())])
    big = random_raw("Q4_0", 2, 32)
    big[:, 0:2] = torch.from_numpy(np.full((2, 1), 30000, np.float16).view(np.uint8))
    with pytest.raises(ValueError, match="beyond fp16"):  # as q4_1 beside Q4_1 rows: -8 d stored
        pack_gguf([("Q4_0", big), ("Q4_1", random_raw("Q4_1", 2, 32))])
    alone = pack_gguf([("Q4_0", big)])  # q4_0: the kernel forms -8 d in fp32, exact
    assert alone.fmt == "q4_0" and torch.equal(unpack(alone), dequantize_gguf("Q4_0", big))


def test_q4_k_q6_k_and_i8_k_sizes() -> None:
    n, k = 64, 4096
    q4k = pack_gguf([("Q4_K", random_raw("Q4_K", n, k))])
    assert q4k.nbytes * 8 / (n * k) == 4.625
    q6k = pack_gguf([("Q6_K", random_raw("Q6_K", n, k))])  # the file's 210 bytes per 256
    assert q6k.fmt == "q6_k" and q6k.nbytes * 8 / (n * k) == 6.5625 == 210 * 8 / 256
    i8k = pack_gguf([("Q6_K", random_raw("Q6_K", n // 2, k)),
                     ("Q4_K", random_raw("Q4_K", n // 2, k))])
    assert i8k.fmt == "i8_k" and i8k.nbytes * 8 / (n * k) == 9.125


MIXES = [(t,) for t in FP16_AT] + [
    ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q2_K", "Q3_K"), ("Q4_0", "Q4_1"), ("Q8_0", "Q5_0"),
    ("Q4_K", "Q5_1", "Q8_0", "Q4_0"), ("Q6_K", "Q4_K")]


def _same_tensors(a, b) -> None:
    for f in ("fmt", "out_features", "in_features", "group", "super_group"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("data", "scale", "minv", "bias", "super_scale", "super_min"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f  # bits, NaN too


@pytest.mark.parametrize("types", MIXES, ids="+".join)
def test_native_packer_writes_the_numpy_paths_bits(types) -> None:
    from kernels.gguf_pack_cpu import build_problem

    if build_problem() is not None:
        pytest.skip(f"the C++ packer does not build here: {build_problem()}")
    # parts of 17, 37, 57 .. rows: part and panel boundaries (64 rows) fall anywhere
    raws = [random_raw(t, 17 + 20 * i, 512, seed=i) for i, t in enumerate(types)]
    bias = torch.randn(sum(r.shape[0] for r in raws)) if len(types) % 2 else None
    native = pack_gguf(list(zip(types, raws)), bias)
    _same_tensors(native, pack_gguf(list(zip(types, raws)), bias, native=False))
    want = torch.cat([dequantize_gguf(t, r) for t, r in zip(types, raws)])
    assert torch.equal(unpack(native), want)


def test_native_packer_refuses_what_the_numpy_path_refuses() -> None:
    from kernels.gguf_pack_cpu import build_problem, pack_blocks

    if build_problem() is not None:
        pytest.skip(f"the C++ packer does not build here: {build_problem()}")
    big = random_raw("Q4_0", 2, 64)
    big[1, 18:20] = torch.from_numpy(np.full(1, 30000, np.float16).view(np.uint8))
    mix = [("Q4_0", big), ("Q4_1", random_raw("Q4_1", 2, 64))]  # q4_1: -8 d stored in fp16
    for native in (True, False):
        with pytest.raises(ValueError, match="beyond fp16"):
            pack_gguf(mix, native=native)
    raw = random_raw("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="cannot be packed as q6_k"):
        pack_blocks([("Q4_K", raw)], "q6_k", 256, 256, None)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_blocks([("Q4_K", raw)], "q4_k", 512, 256, None)  # the rows hold 256 weights
    with pytest.raises(ValueError, match="fmt must be"):
        pack_blocks([("Q4_K", raw)], "int4", 256, 256, None)
