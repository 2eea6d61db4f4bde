"""The int16-activation formats on AMX-INT8 tiles (kernels/csrc/quant_linear_cpu.cpp,
CONVEYOR_AMX): every x16 format, group, row count and tile edge gives the avx512 build's bits.

The ``amx`` build runs only on a CPU with AMX (its tests skip elsewhere); ``amxemu`` runs the
same tile code on a scalar model of the AMX instructions, so that every AVX512-VNNI CPU checks
the layout, the tile configuration and the float steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from kernels.quant_pack import ACT16_FORMATS, with_int16_activations
from tests.kernels.test_quant_linear_cpu import _data, _k_packed, _pack

TILE_ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    qlc.isa_problem(isa) is not None, reason=f"{isa} build unavailable: {qlc.isa_problem(isa)}"))
    for isa in (*qlc.ACT16_VARIANTS, *qlc.TEST_VARIANTS)]
pytestmark = pytest.mark.skipif(qlc.isa_problem("avx512") is not None,
                                reason="the tiles' bits are checked against the avx512 build")
ROWS = [15, 16, 17, 31, 32, 40, 128, 129, 300]
"""Row counts: below the tiles (the avx512 code), whole and partial 16-row tiles, the edges of
the 128-row blocks of a work item."""


def _assert_avx512_bits(x: torch.Tensor, packed, isa: str) -> None:
    full = qlc.quant_linear(x, packed, "avx512")
    assert torch.equal(qlc.quant_linear(x, packed, isa), full)
    for rows in ROWS:
        if rows <= x.shape[0]:
            assert torch.equal(qlc.quant_linear(x[:rows], packed, isa), full[:rows])


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("fmt", sorted(ACT16_FORMATS))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_legacy_x16_formats_give_the_avx512_bits(isa, fmt, group) -> None:
    """q4_1 / q4_0 / q8_0 x16 over groups of 32 (GGUF's), 64 (one tile product a group) and
    128 (two, summed in the tile): with a bias, 150 channels (a partial last panel pair), an
    outlier in one group, rows up to 300."""
    w, b, x = _data(150, 256, 300, seed=group)
    x[3, 7] = 60.0
    _assert_avx512_bits(x, _pack(fmt, w, b, group), isa)


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("types", [("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q4_K", "Q4_K", "Q6_K"),
                                   ("Q4_K", "Q5_1", "Q8_0")])
def test_k_x16_formats_give_the_avx512_bits(isa, types) -> None:
    """q4_k, q5_k, q6_k (groups of 16: B tiles of 4 rows), a mixed split weight and i8_k
    over blocks of 32; the single formats also with every byte at 255 and at 0 (the largest
    nibbles and high bits; q6_k's q - 32 at -32)."""
    g = torch.Generator().manual_seed(len(types))
    x = torch.randn(140, 512, generator=g)
    x[1, 2] = 40.0
    base = _k_packed(types, 70, 512)
    fills = (None, 255, 0) if len(types) == 1 else (None,)  # the mixes: a split weight
    for fill in fills:
        packed = base if fill is None else \
            dataclasses.replace(base, data=torch.full_like(base.data, fill))
        _assert_avx512_bits(x, with_int16_activations(packed), isa)


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_non_finite_rows_stay_non_finite_and_strided_rows_work(isa) -> None:
    """A NaN or an infinity in a row's x makes that row's outputs NaN and leaves the other
    rows' bits alone; x rows further apart than K and a strided out are read and written as
    the avx512 build does."""
    w, b, x = _data(64, 96, 40)
    packed = _pack("q4_0x16", w, b)
    x[2, 5], x[21, 40] = float("nan"), float("inf")
    y = qlc.quant_linear(x, packed, isa)
    assert bool(y[2].isnan().all()) and not bool(y[21].isfinite().any())
    keep = [i for i in range(40) if i not in (2, 21)]
    assert torch.equal(y[keep], qlc.quant_linear(x, packed, "avx512")[keep])
    wide = torch.zeros(40, 200)
    wide[:, 50:146] = x
    out = torch.full((40, 100), 7.0)
    qlc.quant_linear(wide[:, 50:146], packed, isa, out=out[:, 10:74])
    assert torch.equal(out[keep, 10:74], y[keep])
    assert bool((out[:, :10] == 7.0).all()) and bool((out[:, 74:] == 7.0).all())


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_thread_counts_give_the_same_bits(isa) -> None:
    w, b, x = _data(260, 512, 70, seed=9)
    packed = _pack("q8_0x16", w, b)
    y = qlc.quant_linear(x, packed, isa)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qlc.quant_linear(x, packed, isa), y)
    finally:
        torch.set_num_threads(before)


def test_the_tile_builds_are_offered_for_x16_only_and_never_the_emulation() -> None:
    """``amx`` serves only the x16 paths, from AMX_MIN_ROWS rows (below, it would time the
    avx512 code again), and is not a general build; ``amxemu`` is never a serving path."""
    from service.worker.quantization.paths import AMX_MIN_ROWS, PATHS

    assert "amx" not in qlc.available_isas() and "amxemu" not in qlc.available_isas()
    amx = [name for name in PATHS if name.endswith("-amx")]
    assert amx and all(name.rsplit("-", 1)[0].endswith("x16") for name in amx)
    assert all(PATHS[name].min_rows == AMX_MIN_ROWS for name in amx)
    assert not any(name.endswith("-amxemu") for name in PATHS)


@pytest.mark.skipif(qlc.isa_problem("amxemu") is not None, reason="needs the amxemu build")
def test_a_self_check_that_crashes_refuses_the_build_and_spares_the_process(monkeypatch) -> None:
    """The tiles' self-check runs in a child process first: a fault there (here a SIGSEGV
    standing in for an instruction this CPU refuses) refuses the build with the signal named,
    and this process goes on."""
    lib = qlc.library("amxemu").load()
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(qlc, "_CHILD_CHECK", crash)
    with pytest.raises(qlc.KernelBuildError, match="exit -11"):
        qlc._setup_tiles(lib)
    monkeypatch.setattr(qlc, "_CHILD_CHECK", "import sys; sys.exit(3)")
    with pytest.raises(qlc.KernelBuildError, match="other bits"):
        qlc._setup_tiles(lib)
