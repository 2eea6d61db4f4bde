"""paged_attention (Triton) and paged_attention_ref (torch) against a naive loop."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, paged_attention_ref, plan_attention_work

# (context length incl. this step, query tokens) per sequence.
SCENARIOS = {
    # contexts ending mid-block and on a block boundary
    "decode": [(5, 1), (16, 1), (1, 1), (23, 1)],
    # prefill from position 0, one chunk shorter than a block
    "prefill": [(9, 9), (3, 3), (17, 17)],
    # decodes, a fresh prefill and chunks after earlier context, one batch
    "mixed": [(12, 1), (7, 7), (21, 5), (1, 1), (30, 13), (9, 2)],
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_ref_matches_naive_loop(make_paged_batch, naive_attention, scenario, group, block_size) -> None:
    batch = make_paged_batch(
        SCENARIOS[scenario], block_size=block_size, num_kv_heads=2, group=group,
        head_dim=16, dtype=torch.float32, device=torch.device("cpu"), seed=1,
    )
    out = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_matches_ref_fp32(make_paged_batch, device, scenario, group, block_size) -> None:
    batch = make_paged_batch(
        SCENARIOS[scenario], block_size=block_size, num_kv_heads=2, group=group,
        head_dim=16, dtype=torch.float32, device=device, seed=2,
    )
    args = (batch.q, batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    out = paged_attention(*args)
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_triton_matches_ref_half(make_paged_batch, naive_attention, device, tolerance, dtype, group) -> None:
    batch = make_paged_batch(
        SCENARIOS["mixed"], block_size=16, num_kv_heads=2, group=group,
        head_dim=32, dtype=dtype, device=device, seed=3,
    )
    args = (batch.q, batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    out = paged_attention(*args)
    assert out.dtype == dtype
    tol = tolerance[dtype]
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double().cpu(), naive_attention(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_fp32_q_over_a_16bit_cache_is_attention_over_its_values(make_paged_batch, device,
                                                                 cache_dtype, group) -> None:
    # --kv-cache-dtype float16 / bfloat16 under fp32 activations: both implementations
    # attend over the cache's values widened to fp32 (the ref bit for bit, Triton to fp32
    # tolerance), and the output stays fp32.
    batch = make_paged_batch(
        SCENARIOS["mixed"], block_size=16, num_kv_heads=2, group=group,
        head_dim=32, dtype=torch.float32, device=device, seed=7,
    )
    k16, v16 = batch.kv[0].to(cache_dtype), batch.kv[1].to(cache_dtype)
    rest = (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    widened = paged_attention_ref(batch.q, k16.float(), v16.float(), *rest)
    ref = paged_attention_ref(batch.q, k16, v16, *rest)
    assert ref.dtype == torch.float32 and torch.equal(ref, widened)
    out = paged_attention(batch.q, k16, v16, *rest)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, widened, atol=1e-4, rtol=1e-4)


def test_triton_many_query_tiles_and_long_context(make_paged_batch, device) -> None:
    # A 40-token chunk after 50 tokens of context spans several query tiles
    # and several key tiles; group 4 with 4 kv heads exercises 16 q heads.
    batch = make_paged_batch(
        [(90, 40), (70, 1)], block_size=16, num_kv_heads=1, group=4,
        head_dim=16, dtype=torch.float32, device=device, seed=4,
    )
    args = (batch.q, batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    torch.testing.assert_close(paged_attention(*args), paged_attention_ref(*args), atol=1e-4, rtol=1e-4)


def test_triton_accepts_strided_q_and_skips_empty_sequences(make_paged_batch, device) -> None:
    # q as a slice of a fused QKV output (row stride > Hq * D); a sequence
    # with no query token this step leaves the output untouched.
    batch = make_paged_batch(
        [(6, 1), (10, 0), (11, 3)], block_size=8, num_kv_heads=2, group=3,
        head_dim=16, dtype=torch.float32, device=device, seed=5,
    )
    tokens, heads, dim = batch.q.shape
    fused = torch.randn(tokens, heads * dim + 40, device=device)
    fused[:, : heads * dim] = batch.q.reshape(tokens, -1)
    q_view = fused[:, : heads * dim].view(tokens, heads, dim)
    assert not q_view.is_contiguous()
    rest = (batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    out = paged_attention(q_view, *rest)
    torch.testing.assert_close(out, paged_attention_ref(batch.q, *rest), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", [paged_attention, paged_attention_ref])
def test_bad_shapes_raise_value_error(make_paged_batch, device, impl) -> None:
    batch = make_paged_batch(
        [(5, 1), (4, 4)], block_size=8, num_kv_heads=2, group=1,
        head_dim=16, dtype=torch.float32, device=device, seed=6,
    )
    rest = (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    with pytest.raises(ValueError, match="multiple of"):
        impl(batch.q[:, :1], batch.kv[0], batch.kv[1], *rest)
    with pytest.raises(ValueError, match="q must be"):
        impl(batch.q[0], batch.kv[0], batch.kv[1], *rest)
    with pytest.raises(ValueError, match="dtypes differ"):
        impl(batch.q, batch.kv[0], batch.kv[1].half(), *rest)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        impl(batch.q, batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens,
             batch.cu_seqlens_q[:-1], batch.scale)


def test_ref_rejects_chunk_longer_than_context(make_paged_batch) -> None:
    batch = make_paged_batch(
        [(5, 1), (4, 4)], block_size=8, num_kv_heads=2, group=1,
        head_dim=16, dtype=torch.float32, device=torch.device("cpu"), seed=7,
    )
    with pytest.raises(ValueError, match="context length 3"):
        paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                            batch.seq_lens - torch.tensor([0, 1], dtype=torch.int32),
                            batch.cu_seqlens_q, batch.scale)


def test_plan_attention_work_exact_grid() -> None:
    # Query lengths [1, 30, 0, 1], group 3: 64-row tiles hold 21 tokens.
    work = plan_attention_work(torch.tensor([0, 1, 31, 31, 32]), 6, 2, "cpu")
    assert (work.block_m, work.group) == (64, 3)
    assert work.work_seq.tolist() == [0, 1, 1, 3]
    assert work.work_tile.tolist() == [0, 0, 1, 0]
    assert work.work_seq.dtype == torch.int32
    # Decode-only with group 1: 16 tokens per tile; a long chunk switches to 64-row tiles.
    assert plan_attention_work([0, 1, 2], 2, 2, "cpu").block_m == 16
    long = plan_attention_work([0, 1, 131], 4, 2, "cpu")
    assert long.block_m == 64 and long.work_tile.tolist() == [0, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        plan_attention_work([0, 1], 5, 2, "cpu")


def test_precomputed_work_plan_gives_same_result(make_paged_batch, device) -> None:
    batch = make_paged_batch(
        SCENARIOS["mixed"], block_size=8, num_kv_heads=2, group=3,
        head_dim=16, dtype=torch.float32, device=device, seed=8,
    )
    args = (batch.q, batch.kv[0], batch.kv[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    work = plan_attention_work(batch.cu_seqlens_q.cpu(), 6, 2, device)
    assert torch.equal(paged_attention(*args, work=work), paged_attention(*args))
    assert torch.equal(paged_attention_ref(*args, work=work), paged_attention_ref(*args))
    with pytest.raises(ValueError, match="work plan is for group 1"):
        paged_attention(*args, work=plan_attention_work(batch.cu_seqlens_q.cpu(), 2, 2, device))


def test_int64_metadata(make_paged_batch, device) -> None:
    # The model runner may build block tables and offsets as int64.
    batch = make_paged_batch(
        SCENARIOS["mixed"], block_size=16, num_kv_heads=2, group=3,
        head_dim=16, dtype=torch.float32, device=device, seed=9,
    )
    meta32 = (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    meta64 = tuple(t.long() for t in meta32)
    kv = (batch.q, batch.kv[0], batch.kv[1])
    expected = paged_attention_ref(*kv, *meta32, batch.scale)
    torch.testing.assert_close(paged_attention(*kv, *meta64, batch.scale), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged_attention_ref(*kv, *meta64, batch.scale), expected, atol=1e-6, rtol=1e-6)
