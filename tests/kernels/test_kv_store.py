"""store_kv (Triton) and store_kv_ref (torch) against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from kernels import _triton, store_kv, store_kv_ref


def _case(device: torch.device, dtype: torch.dtype, block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, dim, tokens = 5, 3, 16, 9
    k = torch.randn((tokens, heads, dim), generator=gen).to(device, dtype)
    v = torch.randn((tokens, heads, dim), generator=gen).to(device, dtype)
    kv = torch.randn((2, num_blocks, block_size, heads, dim), generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # skipped tokens
    return k, v, kv, slots.to(device)


def _naive(k, v, kv, slots) -> torch.Tensor:
    expected = kv.clone()
    block_size = kv.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = k[t]
            expected[1, slot // block_size, slot % block_size] = v[t]
    return expected


@pytest.mark.parametrize("block_size", [8, 16])
def test_ref_matches_naive_loop(block_size) -> None:
    k, v, kv, slots = _case(torch.device("cpu"), torch.float32, block_size, seed=1)
    expected = _naive(k, v, kv, slots)
    store_kv_ref(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_matches_naive_loop(device, dtype, block_size) -> None:
    k, v, kv, slots = _case(device, dtype, block_size, seed=2)
    expected = _naive(k, v, kv, slots)
    store_kv(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)  # a copy: bit-exact


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", [store_kv, store_kv_ref])
def test_fp32_rows_into_a_16bit_cache_round_as_torch_does(device, impl, cache_dtype) -> None:
    # --kv-cache-dtype float16 / bfloat16 under fp32 activations: each stored value is the
    # bits of k.to(cache_dtype) (round to nearest even), and skipped slots keep theirs.
    k, v, kv, slots = _case(device, torch.float32, 8, seed=6)
    k[0, 0, :3] = torch.tensor([1e-8, 70000.0, 1 + 2 ** -11])  # subnormal-ish, overflow, a tie
    cache = kv.to(cache_dtype)
    expected = _naive(k.to(cache_dtype), v.to(cache_dtype), cache, slots)
    impl(k, v, cache[0], cache[1], slots)
    got, want = cache.view(torch.int16), expected.view(torch.int16)
    if impl is store_kv and cache_dtype == torch.bfloat16 and _triton.interpret_enabled():
        # Triton's interpreter narrows fp32 -> bf16 by truncation (compiled Triton rounds to
        # nearest even): one unit in the last place apart, never more
        assert (got.int() - want.int()).abs().max() <= 1 and not torch.equal(k, k.bfloat16().float())
    else:
        assert torch.equal(got, want)


def test_triton_accepts_strided_views(device) -> None:
    # k and v as slices of a fused QKV output, as the model runner passes them.
    k, v, kv, slots = _case(device, torch.float32, 8, seed=3)
    tokens, heads, dim = k.shape
    fused = torch.cat([torch.randn(tokens, 7, device=device), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1)
    k_view = fused[:, 7 : 7 + heads * dim].view(tokens, heads, dim)
    v_view = fused[:, 7 + heads * dim :].view(tokens, heads, dim)
    assert not k_view.is_contiguous()
    expected = _naive(k, v, kv, slots)
    store_kv(k_view, v_view, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)


def test_all_slots_skipped_writes_nothing(device) -> None:
    k, v, kv, slots = _case(device, torch.float32, 8, seed=4)
    before = kv.clone()
    for impl in (store_kv, store_kv_ref):
        impl(k, v, kv[0], kv[1], torch.full_like(slots, -1))
    assert torch.equal(kv, before)


@pytest.mark.parametrize("impl", [store_kv, store_kv_ref])
def test_bad_arguments_raise_value_error(device, impl) -> None:
    k, v, kv, slots = _case(device, torch.float32, 8, seed=5)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        impl(k, v, kv[0], kv[1], slots[:-1])
    with pytest.raises(ValueError, match="k_cache must be"):
        impl(k[:, :2], v[:, :2], kv[0], kv[1], slots)
    with pytest.raises(ValueError, match="contiguous"):
        impl(k, v, kv[0].transpose(0, 1), kv[1].transpose(0, 1), slots)
    with pytest.raises(ValueError, match="dtypes"):
        impl(k.half(), v, kv[0], kv[1], slots)
    with pytest.raises(ValueError, match="dtypes"):
        impl(k, v, kv[0], kv[1].half(), slots)
    with pytest.raises(ValueError, match="dtypes"):
        impl(k, v, kv[0].to(torch.int16), kv[1].to(torch.int16), slots)
