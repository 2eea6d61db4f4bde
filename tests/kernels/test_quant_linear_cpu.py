"""kernels.quant_linear_cpu against its torch reference (kernels.quant_pack), every format
on every build this CPU runs: odd shapes, 1 to 300 rows, row and thread invariance, the
AVX2 and AVX-512 builds bit-identical, argument checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from kernels.quant_pack import (ACT8_FORMATS, ACT16_FORMATS, FORMATS, PackedWeight, pack_f32, pack_int4,
                                pack_int8, pack_k_blocks, pack_q4_0_blocks, pack_q4_1,
                                pack_q4_1_blocks,
                                pack_q6_k_blocks, pack_q8_0,
                                pack_q8_0_blocks, quant_linear_ref, quantize_activations,
                                quantize_int4, unpack, with_int8_activations,
                                with_int16_activations)

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    qlc.isa_problem(isa) is not None, reason=f"{isa} build unavailable: {qlc.isa_problem(isa)}"))
    for isa in qlc.VARIANTS]
SHAPES = [(1, 1), (17, 3), (100, 37), (64, 130), (130, 64), (100, 96), (960, 576)]
ROWS = [1, 7, 16, 64, 300]


def _pack(fmt: str, w: torch.Tensor, b: torch.Tensor | None, group: int = 32) -> PackedWeight:
    if fmt in ACT8_FORMATS or fmt in ACT16_FORMATS:  # int8 / int16 activations, q4_1 / q8_0
        if w.shape[1] % group:
            pytest.skip(f"{fmt} needs K a multiple of the group ({w.shape[1]}, {group})")
        if fmt in ACT16_FORMATS:
            return with_int16_activations(_pack(ACT16_FORMATS[fmt], w, b, group))
        return with_int8_activations(_pack(ACT8_FORMATS[fmt], w, b, group))
    if fmt == "f32":
        return pack_f32(w, b)
    if fmt == "q4_1":
        return pack_q4_1(w, b, group=group)
    if fmt == "q4_0":
        return _pack_q4_0(w, b, group)
    if fmt == "q8_0":
        return pack_q8_0(w, b, group=group)
    return pack_int8(w, b) if fmt == "int8" else pack_int4(w, b, group=group)


def _pack_q4_0(w: torch.Tensor, b: torch.Tensor | None, group: int) -> PackedWeight:
    """fp32 -> q4_0 as llama.cpp rounds it: d = max |w| / 8 per group (fp16), q = round(w / d)
    + 8 in [0, 15]."""
    n, k = w.shape
    d = (w.view(n, k // group, group).abs().amax(-1) / 8).half()
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = (torch.round(w / d.float().repeat_interleave(group, 1)) + 8).clamp(0, 15)
    return pack_q4_0_blocks(q.to(torch.uint8), d, b, group=group)


def _data(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]
    return w, torch.randn(n, generator=g), torch.randn(rows, k, generator=g)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_reference(isa, fmt, n, k) -> None:
    w, b, x = _data(n, k, max(ROWS))
    packed = _pack(fmt, w, b if n % 2 else None)
    ref = quant_linear_ref(x, packed)
    y = qlc.quant_linear(x, packed, isa)
    assert y.shape == (max(ROWS), n) and y.dtype == torch.float32
    # fp32 accumulation over k vs the float64 reference
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    for rows in ROWS:  # any row count gives the same bits for the same rows
        assert torch.equal(qlc.quant_linear(x[:rows], packed, isa), y[:rows])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_never_depend_on_each_other_or_the_threads(isa, fmt) -> None:
    w, b, x = _data(200, 96, 64, seed=3)
    packed = _pack(fmt, w, b)
    y = qlc.quant_linear(x, packed, isa)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qlc.quant_linear(x[perm], packed, isa), y[perm])
    assert torch.equal(qlc.quant_linear(x[5:6], packed, isa), y[5:6])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qlc.quant_linear(x, packed, isa), y)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(qlc.available_isas()) < 2,
                    reason=f"needs both builds; this CPU runs {qlc.available_isas()}")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
def test_avx2_and_avx512_builds_are_bit_identical(fmt, rows) -> None:
    w, b, x = _data(300, 201, rows, seed=rows)
    packed = _pack(fmt, w, b)
    assert torch.equal(qlc.quant_linear(x, packed, "avx2"), qlc.quant_linear(x, packed, "avx512"))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int4", "q4_1", "q8_0"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_sizes_and_partial_last_group(isa, fmt, group) -> None:
    w, b, x = _data(70, 200, 9)  # 200 = 1 full group of 128 and a partial one
    packed = _pack(fmt, w, b, group=group)
    ref = quant_linear_ref(x, packed)
    torch.testing.assert_close(qlc.quant_linear(x, packed, isa), ref, rtol=1e-4,
                               atol=1e-4 * float(ref.abs().max()))
    for rows in (1, 5):
        assert torch.equal(qlc.quant_linear(x[:rows], packed, isa),
                           qlc.quant_linear(x, packed, isa)[:rows])


def _q4_blocks(n: int, k: int, seed: int = 0, group: int = 32) -> tuple[torch.Tensor, ...]:
    """Random GGUF-like Q4_1 blocks: q [N, K] in [0, 15], fp16 d > 0 and m [N, K / group]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // group, generator=g) * 0.2).half()
    return q, d, m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
def test_q4_1_is_int4_with_fp16_scales_bit_for_bit(isa, rows) -> None:
    """q4_1 (fp16 d / min, converted exactly in the kernel) runs int4's fp32 sequence: over
    the same values both give the same bits, in every path (one row, tiles, strips)."""
    q, d, m = _q4_blocks(200, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1))
    half = pack_q4_1_blocks(q, d, m, group=32)
    full = dataclasses.replace(half, fmt="int4", scale=half.scale.float(), minv=half.minv.float())
    assert half.scale.dtype == torch.float16 and half.minv.dtype == torch.float16
    assert torch.equal(unpack(half), unpack(full))
    assert torch.equal(qlc.quant_linear(x, half, isa), qlc.quant_linear(x, full, isa))


def test_q4_1_and_q8_0_blocks_dequantize_as_gguf() -> None:
    """The weight is the file's: Q4_1 d * q + m (fp32, as gguf-py and ggml dequantize),
    Q4_0 (q - 8) d as q4_1 with m = -8 d, Q8_0 d * q, each exactly."""
    q, d, m = _q4_blocks(40, 64)
    g_of_k = torch.arange(64) // 32
    want = d.float()[:, g_of_k] * q.float() + m.float()[:, g_of_k]
    assert torch.equal(unpack(pack_q4_1_blocks(q, d, m)), want)
    q0 = (q.to(torch.int16) - 8).float()
    assert torch.equal(unpack(pack_q4_1_blocks(q, d, -8 * d)), d.float()[:, g_of_k] * q0)
    q8 = torch.randint(-127, 128, (40, 64), dtype=torch.int8,
                       generator=torch.Generator().manual_seed(2))
    assert torch.equal(unpack(pack_q8_0_blocks(q8, d)), d.float()[:, g_of_k] * q8.float())


def test_block_packers_reject_bad_blocks() -> None:
    q, d, m = _q4_blocks(8, 64)
    with pytest.raises(ValueError, match="d must be"):
        pack_q4_1_blocks(q, d.float(), m)
    with pytest.raises(ValueError, match="d must be"):
        pack_q4_1_blocks(q, d[:, :1], m[:, :1])
    with pytest.raises(ValueError, match="m must be"):
        pack_q4_1_blocks(q, d, m.float())
    with pytest.raises(ValueError, match="0, 15"):
        pack_q4_1_blocks(q | 16, d, m)
    with pytest.raises(ValueError, match="q must be"):
        pack_q8_0_blocks(q, d)
    with pytest.raises(ValueError, match="fp16 range"):
        pack_q8_0(torch.full((2, 32), 1e7))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_the_reference_weight(isa, fmt) -> None:
    w, b, _ = _data(100, 37, 1)
    packed = _pack(fmt, w, b)
    assert torch.equal(qlc.dequantize(packed, isa), unpack(packed))


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_out_and_empty_input(isa) -> None:
    w, b, x = _data(48, 32, 5)
    packed = pack_int8(w, b)
    wide = torch.randn(5, 80)
    wide[:, 16:48] = x  # rows 80 apart, as a slice of a fused projection
    y = qlc.quant_linear(x, packed, isa)
    assert torch.equal(qlc.quant_linear(wide[:, 16:48], packed, isa), y)
    out = torch.full((5, 60), float("nan"))
    res = qlc.quant_linear(x, packed, isa, out=out[:, 6:54])
    assert torch.equal(res, y) and torch.equal(out[:, 6:54], y)
    assert bool(out[:, :6].isnan().all() and out[:, 54:].isnan().all())  # nothing outside
    assert qlc.quant_linear(torch.empty(0, 32), packed, isa).shape == (0, 48)


@pytest.mark.parametrize("isa", ISAS)
def test_bad_arguments_raise_value_error(isa) -> None:
    w, b, x = _data(48, 32, 4)
    packed = pack_int8(w, b)
    with pytest.raises(ValueError, match="float32"):
        qlc.quant_linear(x.double(), packed, isa)
    with pytest.raises(ValueError, match="input features"):
        qlc.quant_linear(torch.randn(4, 31), packed, isa)
    with pytest.raises(ValueError, match="unit stride"):
        qlc.quant_linear(torch.randn(32, 4).t(), packed, isa)
    with pytest.raises(ValueError, match="out must be"):
        qlc.quant_linear(x, packed, isa, out=torch.empty(4, 47))
    with pytest.raises(ValueError, match="isa"):
        qlc.quant_linear(x, packed, "sse2")


def test_int4_quantization_error_within_half_a_step() -> None:
    w, _, _ = _data(33, 100, 1)
    w[0, :32] = 0.25  # a constant group is exact
    q, d, m = quantize_int4(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    g_of_k = torch.arange(100) // 32
    deq = q.float() * d[:, g_of_k] + m[:, g_of_k]
    assert bool(((deq - w).abs() <= d[:, g_of_k] / 2 + 1e-6).all())
    assert torch.equal(deq[0, :32], w[0, :32])
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(w, 48)


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, dtype=torch.int32),
                                 torch.tensor([[1.0, float("nan")]]), torch.zeros(0, 3)])
def test_pack_rejects_bad_weights(bad) -> None:
    for pack in (pack_f32, pack_int8, pack_int4, pack_q4_1, pack_q8_0):
        with pytest.raises(ValueError):
            pack(bad)
    with pytest.raises(ValueError, match="bias"):
        pack_int8(torch.randn(4, 3), torch.randn(5))


def test_packed_sizes() -> None:
    w = torch.randn(100, 64)
    assert pack_f32(w).data.shape == (2, 64, 64)  # 100 channels padded to 128
    assert pack_int8(w).nbytes == 128 * 64 + 128 * 4
    p = pack_int4(w, group=32)
    assert p.data.shape == (2, 32, 64) and p.scale.shape == (2, 2, 64)
    assert p.nbytes == 128 * 32 + 2 * 128 * 2 * 4
    # GGUF's byte budget: Q4_1 5.0 bits a weight (fp16 d and min), Q8_0 8.5 bits
    p = pack_q4_1(torch.randn(128, 64))
    assert p.scale.shape == (2, 2, 64) and p.nbytes * 8 / (128 * 64) == 5.0
    p = pack_q8_0(torch.randn(128, 64))
    assert p.data.dtype == torch.int8 and p.minv is None and p.nbytes * 8 / (128 * 64) == 8.5


# (base format, bound on the relative error against the fp32-activation product, extra row
# counts) per activation-quantizing format: x8's tiles are 4 / 2 / 1 rows; x16's 6 down to 1,
# in work items of 48 rows, with a strip of unpacked weights from 12 rows (AVX2's q5_k and
# q6_k: from 7; 1 row: whole blocks; 2 and 3 rows: half blocks); x16 on a CPU with
# AVX512-VNNI: whole-block tiles of 4 rows down to 1 below 8 rows, half-block tiles of 6 down
# to 1 from 8, items of 48 rows.
ACT_CASES = {**{f: (base, 0.02, [2, 3, 5, 9]) for f, base in ACT8_FORMATS.items()},
             **{f: (base, 1e-4, [2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 47, 48, 49, 97])
                for f, base in ACT16_FORMATS.items()}}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(ACT_CASES))
@pytest.mark.parametrize("group", [32, 64])
def test_act_formats_match_their_reference_and_stay_near_fp32(isa, fmt, group) -> None:
    """The x8 / x16 formats compute the weight's integers times x rounded to int8 / int16
    per row and group, as the reference does (float64 over the same integers); that
    product is within the rounding of the fp32-activation one (relative error below 0.02
    for int8, 1e-4 for int16), and the same rows give the same bits in every call (1 to
    300 rows, across every tile, item and strip edge)."""
    base, bound, extra_rows = ACT_CASES[fmt]
    w, b, x = _data(150, 256, max(ROWS), seed=group)
    x[3, 7] = 60.0  # an outlier channel in one group of one row
    packed = _pack(fmt, w, b, group)
    assert packed.fmt == fmt
    y = qlc.quant_linear(x, packed, isa)
    ref = quant_linear_ref(x, packed)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = quant_linear_ref(x, _pack(base, w, b, group))
    assert float((y - exact).norm() / exact.norm()) < bound
    for rows in ROWS + extra_rows:
        assert torch.equal(qlc.quant_linear(x[:rows], packed, isa), y[:rows])
        for other in qlc.available_isas():  # e.g. VNNI tiles against AVX2's vpmaddwd ones
            assert torch.equal(qlc.quant_linear(x[:rows], packed, other), y[:rows])
    assert torch.equal(qlc.dequantize(packed, isa), unpack(packed))  # q4_1's / q8_0's weights


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["", "x8", "x16"])
def test_q4_0_gives_the_bits_of_q4_1_with_its_min_stored(isa, act) -> None:
    """q4_0 (no stored mins: the kernel forms -8 d) against q4_1 over the same blocks with
    m = -8 d stored in fp16: the same bits in every path, row count and build, at 4.5 bits a
    weight instead of 5.0."""
    w, b, x = _data(150, 256, max(ROWS), seed=3)
    q40 = _pack_q4_0(w, b, 32)
    d16 = q40.scale.movedim(-1, 1).reshape(q40.padded_out, -1)[:150]
    q = unpack(dataclasses.replace(q40, fmt="q4_1", minv=torch.zeros_like(q40.scale)))
    q = torch.round(q / d16.float().repeat_interleave(32, 1)).to(torch.uint8)  # the nibbles
    q41 = pack_q4_1_blocks(q, d16, -8 * d16, b, group=32)
    assert torch.equal(unpack(q40), unpack(q41))
    assert q40.nbytes < q41.nbytes and q40.minv is None
    if act:
        wrap = with_int8_activations if act == "x8" else with_int16_activations
        q40, q41 = wrap(q40), wrap(q41)
        assert q40.fmt == "q4_0" + act
    for rows in ROWS + [2, 3, 5, 9, 47, 48, 49]:
        got = qlc.quant_linear(x[:rows], q40, isa)
        assert torch.equal(got, qlc.quant_linear(x[:rows], q41, isa)), rows
    torch.testing.assert_close(qlc.quant_linear(x, q40, isa), quant_linear_ref(x, q40),
                               rtol=1e-4, atol=1e-3)
    assert torch.equal(qlc.dequantize(q40, isa), qlc.dequantize(q41, isa))


def test_act8_rounding_of_x_is_as_documented() -> None:
    """d = max |x| / 127 per group, q = round-half-even(x / d) in [-127, 127], all-zero
    groups give d = 0 and q = 0."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)
    x[0, 40] = 0.5
    q, d = quantize_activations(x, 32)
    assert q.dtype == torch.int8 and d.shape == (2, 2)
    assert float(d[0, 0]) == pytest.approx(2.0 / 127) and int(q[0, 0]) == -127
    assert int(q[0, 40]) == 127 and int(q[0, 41]) == 0
    assert bool((d[1] == 0).all()) and bool((q[1] == 0).all())


@pytest.mark.parametrize("isa", ISAS)
def test_act8_refuses_k_that_is_not_a_multiple_of_the_group(isa) -> None:
    w, b, x = _data(64, 48, 2)
    base = pack_q4_1(w, b)
    with pytest.raises(ValueError, match="multiple"):
        with_int8_activations(base)
    with pytest.raises(ValueError, match="q4_1, q4_0 and q8_0"):
        with_int8_activations(pack_int8(w, b))
    forced = dataclasses.replace(base, fmt="q4_1x8")  # past the Python check: the kernel's own
    with pytest.raises(ValueError, match="rejected"):
        qlc.quant_linear(x, forced, isa)


def test_act16_rounding_of_x_is_as_documented() -> None:
    """d = max |x| / 32767 per group, q = round-half-even(x / d) in [-32767, 32767] (int16),
    all-zero groups give d = 0 and q = 0; only 127 and 32767 levels exist."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)
    x[0, 40] = 0.5
    q, d = quantize_activations(x, 32, levels=32767)
    assert q.dtype == torch.int16 and d.shape == (2, 2)
    assert float(d[0, 0]) == pytest.approx(2.0 / 32767) and int(q[0, 0]) == -32767
    assert int(q[0, 31]) == round(1.0 / float(d[0, 0])) == 16384
    assert int(q[0, 40]) == 32767 and int(q[0, 41]) == 0
    assert bool((d[1] == 0).all()) and bool((q[1] == 0).all())
    with pytest.raises(ValueError, match="levels"):
        quantize_activations(x, 32, levels=255)


@pytest.mark.parametrize("isa", ISAS)
def test_act16_refuses_groups_its_int32_sums_cannot_hold(isa) -> None:
    """A group's integer sum must fit int32: at most 256 products; K a multiple of it."""
    w, b, x = _data(64, 1024, 2)
    base = pack_q8_0(w, b, group=512)
    with pytest.raises(ValueError, match="at most 256"):
        with_int16_activations(base)
    forced = dataclasses.replace(base, fmt="q8_0x16")  # past the Python check: the kernel's
    with pytest.raises(ValueError, match="rejected"):
        qlc.quant_linear(x, forced, isa)
    with pytest.raises(ValueError, match="multiple"):
        with_int16_activations(pack_q4_1(*_data(64, 48, 2)[:2]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(ACT16_FORMATS))
def test_act16_keeps_a_non_finite_row_non_finite_and_the_others_unharmed(isa, fmt) -> None:
    """A NaN or an infinity in a row's x makes that row's outputs NaN, as the fp32 product's
    would be (the step loop then fails that row), and leaves the other rows' bits alone."""
    w, b, x = _data(64, 96, 8)
    packed = _pack(fmt, w, b)
    clean = qlc.quant_linear(x, packed, isa)
    x[2, 5], x[5, 40] = float("nan"), float("inf")
    y = qlc.quant_linear(x, packed, isa)
    assert bool(y[2].isnan().all()) and not bool(y[5].isfinite().any())
    keep = [0, 1, 3, 4, 6, 7]
    assert torch.equal(y[keep], clean[keep])


def _assert_one_row_bits(x: torch.Tensor, packed: PackedWeight, isa: str) -> None:
    """x [48, K] times `packed` is near its float64 reference, and rows 0, 1 and 47 alone
    get the bits they get among the 48, among 2, 3 and 5 (the few-row kernels), and on every
    other build."""
    many = qlc.quant_linear(x, packed, isa)
    torch.testing.assert_close(many, quant_linear_ref(x, packed), rtol=1e-5,
                               atol=1e-5 * float(many.abs().max()))
    for r in (0, 1, 47):
        one = qlc.quant_linear(x[r:r + 1], packed, isa)
        assert torch.equal(one, many[r:r + 1])
        for n in (2, 3, 5):
            assert torch.equal(one, qlc.quant_linear(x[r:r + n], packed, isa)[:1])
        for other in qlc.available_isas():
            assert torch.equal(qlc.quant_linear(x[r:r + 1], packed, other), one)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [8, 32, 64, 256, 6])
@pytest.mark.parametrize("n", [1, 15, 64, 130, 960])
def test_act16_one_row_gives_the_bits_of_every_other_row_count(isa, group, n) -> None:
    """A one-row q4_1x16 call (on an AVX-512 CPU with VNNI: gemv_vnni_block, nibbles and
    int16 activations split into bytes for vpdpbusd; a group that is not a multiple of 8, or
    another CPU: tile16) gives each row the bits it gets in a call of 5 or 48 rows (other
    kernels: half blocks, panels) and in the other build; a non-finite row stays NaN."""
    k = 3 * group if group > 6 else 96
    q, d, m = _q4_blocks(n, k, seed=n + group, group=group)
    g = torch.Generator().manual_seed(n + group + 1)
    x = torch.randn(48, k, generator=g)
    x[1, 2] = 40.0  # an outlier in one group
    for bias in (torch.randn(n, generator=g), None):
        packed = with_int16_activations(pack_q4_1_blocks(q, d, m, bias, group=group))
        _assert_one_row_bits(x, packed, isa)
    bad = x[:1].clone()
    bad[0, k - 1] = float("nan")
    assert bool(qlc.quant_linear(bad, packed, isa).isnan().all())


# ---- GGUF K-quant formats (q4_k, q5_k, q6_k, i8_k) from raw blocks (kernels.gguf_pack) -------------

K_MIXES = [("Q4_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K",), ("Q5_K", "Q2_K", "Q3_K"),
           ("Q4_K", "Q5_1", "Q8_0"), ("Q5_K",)]
"""Parts of a fused weight: q4_k; i8_k over super-blocks of 256; q6_k; i8_k over super-blocks
of 256; i8_k over blocks of 32; q5_k."""
K_ROWS = [1, 2, 7, 16, 64, 300]


def _k_packed(types: tuple[str, ...], n: int, k: int, bias: bool = True) -> PackedWeight:
    from kernels.gguf_pack import pack_gguf
    from tests.kernels.test_gguf_pack import random_raw

    raws = [random_raw(t, n, k, seed=i) for i, t in enumerate(types)]
    b = torch.randn(n * len(types), generator=torch.Generator().manual_seed(1)) if bias else None
    return pack_gguf(list(zip(types, raws)), b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", K_MIXES)
@pytest.mark.parametrize("n,k", [(70, 256), (33, 512), (130, 768), (260, 2048)])
def test_k_formats_match_the_reference_at_every_row_count(isa, types, n, k) -> None:
    """Every row count, including the many-row tiles with (K <= 1024) and without (K 2048: a
    strip past kStripMaxBytes) a strip of unpacked weights: the same bits for a row."""
    packed = _k_packed(types, n, k, bias=n % 2 == 0)
    assert packed.fmt == {("Q4_K",): "q4_k", ("Q6_K",): "q6_k", ("Q5_K",): "q5_k"}.get(types, "i8_k")
    x = torch.randn(max(K_ROWS), k, generator=torch.Generator().manual_seed(2))
    y = qlc.quant_linear(x, packed, isa)
    ref = quant_linear_ref(x, packed)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    for rows in K_ROWS:
        assert torch.equal(qlc.quant_linear(x[:rows], packed, isa), y[:rows])
    perm = torch.randperm(max(K_ROWS), generator=torch.Generator().manual_seed(0))
    assert torch.equal(qlc.quant_linear(x[perm], packed, isa), y[perm])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qlc.quant_linear(x[:64], packed, isa), y[:64])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(qlc.available_isas()) < 2,
                    reason="needs both the AVX2 and AVX-512 builds to run here")
@pytest.mark.parametrize("types", K_MIXES)
def test_k_formats_builds_are_bit_identical(types) -> None:
    packed = _k_packed(types, 100, 512)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(4))
    for rows in K_ROWS:
        assert torch.equal(qlc.quant_linear(x[:rows], packed, "avx512"),
                           qlc.quant_linear(x[:rows], packed, "avx2"))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", K_MIXES)
def test_k_formats_dequantize_to_the_files_values(isa, types) -> None:
    packed = _k_packed(types, 70, 512)
    assert torch.equal(qlc.dequantize(packed, isa), unpack(packed))


@pytest.mark.parametrize("isa", ISAS)
def test_k_formats_refuse_bad_super_blocks(isa) -> None:
    packed = _k_packed(("Q4_K",), 16, 256)
    x = torch.randn(2, 256)
    for bad in (dataclasses.replace(packed, super_group=32),
                dataclasses.replace(packed, super_min=None),
                dataclasses.replace(packed, group=16)):
        with pytest.raises(ValueError, match="rejected"):
            qlc.quant_linear(x, bad, isa)


# ---- K-quant weights times int16 activations (q4_kx16, i8_kx16) --------------------------

K_ACT16_ROWS = ROWS + [2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 47, 48, 49, 97]
"""Every tile, item and strip edge of the x16 kernels (see ACT_CASES)."""


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", K_MIXES)
def test_k_act16_formats_match_their_reference_and_stay_near_fp32(isa, types) -> None:
    """q4_k / i8_k / q6_k weights times x rounded to int16 per row and group of 32 (groups of
    16 each with its own float steps, the scale of the 32 that holds them): as the float64
    reference over the same integers, within 1e-4 of the fp32-activation product, the same
    bits for a row in every call, on every build, and at any thread count."""
    base = _k_packed(types, 130, 512, bias=len(types) > 1)
    packed = with_int16_activations(base)
    assert packed.fmt == base.fmt + "x16" and packed.data is base.data
    x = torch.randn(max(ROWS), 512, generator=torch.Generator().manual_seed(5))
    x[3, 7] = 60.0  # an outlier channel in one group of one row
    y = qlc.quant_linear(x, packed, isa)
    ref = quant_linear_ref(x, packed)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = quant_linear_ref(x, base)
    assert float((y - exact).norm() / exact.norm()) < 1e-4
    for rows in K_ACT16_ROWS:
        assert torch.equal(qlc.quant_linear(x[:rows], packed, isa), y[:rows])
        for other in qlc.available_isas():  # VNNI tiles against AVX2's vpmaddwd ones
            assert torch.equal(qlc.quant_linear(x[:rows], packed, other), y[:rows])
    perm = torch.randperm(max(ROWS), generator=torch.Generator().manual_seed(0))
    assert torch.equal(qlc.quant_linear(x[perm], packed, isa), y[perm])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qlc.quant_linear(x[:64], packed, isa), y[:64])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(qlc.dequantize(packed, isa), unpack(base))  # the K-quant's weights


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", [("Q4_K",), ("Q5_K",), ("Q6_K",)])
@pytest.mark.parametrize("n", [1, 15, 64, 130, 960])
def test_k_act16_one_row_gives_the_bits_of_every_other_row_count(isa, types, n) -> None:
    """A one-row q4_k / q5_k / q6_k x16 call (on an AVX-512 CPU with VNNI: gemv_vnni_block,
    q5_k's high bits spread to the transposed bytes, q6_k's values formed whole and their
    offset of 32 taken from the row's group sums; elsewhere the tiles) gives a row the bits
    it gets in calls of 5 and 48 rows and in the other build, with and without a bias, at
    every edge of a 64-channel block; also with every q at its top (15 / 31 / 63: every high
    bit set) and at 0 (q6_k: q - 32 = -32 everywhere)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(48, 512, generator=g)
    x[1, 2] = 40.0  # an outlier in one group
    for bias in (True, False):
        base = _k_packed(types, n, 512, bias=bias)
        for fill in (None, 255, 0):
            packed = base if fill is None else \
                dataclasses.replace(base, data=torch.full_like(base.data, fill))
            _assert_one_row_bits(x, with_int16_activations(packed), isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", [("Q4_K",), ("Q6_K", "Q4_K"), ("Q6_K",)])
def test_k_act16_keeps_a_non_finite_row_non_finite_and_the_others_unharmed(isa, types) -> None:
    packed = with_int16_activations(_k_packed(types, 64, 256))
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(6))
    clean = qlc.quant_linear(x, packed, isa)
    x[2, 5], x[5, 40] = float("nan"), float("inf")
    y = qlc.quant_linear(x, packed, isa)
    assert bool(y[2].isnan().all()) and not bool(y[5].isfinite().any())
    keep = [0, 1, 3, 4, 6, 7]
    assert torch.equal(y[keep], clean[keep])
    assert torch.equal(qlc.quant_linear(x[3:4], packed, isa), y[3:4])  # one-row calls alike
    assert bool(qlc.quant_linear(x[2:3], packed, isa).isnan().all())


@pytest.mark.parametrize("isa", ISAS)
def test_k_act16_refuses_bad_super_blocks(isa) -> None:
    packed = with_int16_activations(_k_packed(("Q4_K",), 16, 256))
    x = torch.randn(2, 256)
    for bad in (dataclasses.replace(packed, super_group=32),
                dataclasses.replace(packed, super_min=None),
                dataclasses.replace(packed, group=16)):
        with pytest.raises(ValueError, match="rejected"):
            qlc.quant_linear(x, bad, isa)
    with pytest.raises(ValueError, match="q6_k and q5_k"):
        with_int16_activations(pack_int8(*_data(64, 64, 1)[:2]))


# ---- q6_k: layers all in Q6_K, 6.5625 bits a weight ------------------------------------

def _q6_k_and_i8_k(n: int, k: int, bias: bool) -> tuple[PackedWeight, PackedWeight]:
    """The same Q6_K blocks as q6_k (pack_gguf) and as i8_k (their K-quant form, mins 0)."""
    from kernels.gguf_pack import _blocks, pack_gguf
    from tests.kernels.test_gguf_pack import random_raw

    raw = random_raw("Q6_K", n, k, seed=n)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)) if bias else None
    q6 = pack_gguf([("Q6_K", raw)], b)
    f = _blocks("Q6_K", raw)
    i8 = pack_k_blocks("i8_k", f.q.to(torch.int8), f.sc.to(torch.int8), f.m.to(torch.int8),
                       f.d, f.dmin, b)
    return q6, i8


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(70, 256), (130, 768), (64, 4096)])
def test_q6_k_gives_i8_k_bits_over_the_same_blocks(isa, n, k) -> None:
    """q6_k's product is i8_k's operations over the same Q6_K blocks (their mins are 0: the
    same values), so the same bits, at every row count (one-row streams, 6 x 2 / 6 x 1 tiles
    and their edges), on every build and thread count; it dequantizes to the file's values."""
    q6, i8 = _q6_k_and_i8_k(n, k, bias=n % 2 == 0)
    assert q6.fmt == "q6_k" and q6.minv is None and q6.super_min is None
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3))
    y = qlc.quant_linear(x, q6, isa)
    torch.testing.assert_close(y, quant_linear_ref(x, q6), rtol=1e-4,
                               atol=1e-4 * float(y.abs().max()))
    assert torch.equal(y, qlc.quant_linear(x, i8, isa))
    for rows in (1, 2, 5, 6, 7, 13, 64):
        assert torch.equal(qlc.quant_linear(x[:rows], q6, isa), y[:rows])
        for other in qlc.available_isas():
            assert torch.equal(qlc.quant_linear(x[:rows], q6, other), y[:rows])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qlc.quant_linear(x[:16], q6, isa), y[:16])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(qlc.dequantize(q6, isa), unpack(q6))
    assert torch.equal(unpack(q6), unpack(i8))


def test_q6_k_packer_rejects_bad_blocks() -> None:
    q = torch.randint(0, 64, (4, 256), dtype=torch.uint8)
    sc, d = torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1, dtype=torch.float16)
    assert pack_q6_k_blocks(q, sc, d).nbytes * 8 / (64 * 256) == 6.5625  # 4 rows padded to 64
    for bad in ((q[:, :128], sc[:, :8], d), (q | 64, sc, d), (q, sc.to(torch.uint8), d),
                (q, sc, d.float()), (q, sc, torch.full((4, 1), float("inf")).half())):
        with pytest.raises(ValueError, match="q6_k"):
            pack_q6_k_blocks(*bad)


@pytest.mark.parametrize("isa", ISAS)
def test_q6_k_refuses_bad_super_blocks(isa) -> None:
    q6, _ = _q6_k_and_i8_k(16, 256, bias=False)
    x = torch.randn(2, 256)
    for bad in (dataclasses.replace(q6, super_group=32), dataclasses.replace(q6, super_scale=None),
                dataclasses.replace(q6, group=32)):
        with pytest.raises(ValueError, match="rejected"):
            qlc.quant_linear(x, bad, isa)
