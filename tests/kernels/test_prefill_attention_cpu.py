"""The C++ prefill attention kernel (kernels.prefill_attention_cpu) against paged_attention_ref:
called directly on chunks with and without earlier context, through cpu_paged_attention's
"cpp" plan, over head layouts, block sizes (multiples of 8 and not) and thread counts; its
argument checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import paged_attention_ref
from kernels import prefill_attention_cpu as pac
from kernels.paged_attention_cpu import cpu_paged_attention, plan_cpu_attention

needs_kernel = pytest.mark.skipif(
    pac.build_problem() is not None, reason=f"C++ kernel does not build here: {pac.build_problem()}")


def _ref(batch):
    return paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                               batch.seq_lens, batch.cu_seqlens_q, batch.scale)


def _direct(batch, threads: int | None = None, bf16_dot: bool = False) -> torch.Tensor:
    """Every sequence's chunk through the kernel, one call each (bf16 products with
    `bf16_dot`)."""
    out = torch.full_like(batch.q, float("nan"))
    cu = batch.cu_seqlens_q.tolist()
    tables = batch.block_tables.to(torch.int64).clamp(min=0)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for b, (a, e) in enumerate(zip(cu, cu[1:])):
            pac.prefill_attention_cpu(batch.q[a:e], batch.kv[0], batch.kv[1], tables[b].contiguous(),
                                      int(batch.seq_lens[b]), out[a:e], batch.scale,
                                      bf16_dot=bf16_dot)
    finally:
        torch.set_num_threads(before)
    return out


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 12, 16, 32])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (16, 2, 1), (80, 1, 4),
                                                         (128, 2, 2)])
def test_chunks_match_ref(make_paged_batch, block_size, head_dim, num_kv_heads, group) -> None:
    # (context, chunk): a whole prompt, chunks after earlier context ending mid-block and on a
    # block edge, a chunk of 2, a tile edge (16 queries) and several tiles
    seqs = [(37, 37), (70, 21), (64, 16), (9, 2), (100, 33)]
    batch = make_paged_batch(seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim, dtype=torch.float32, device=torch.device("cpu"),
                             seed=21)
    torch.testing.assert_close(_direct(batch), _ref(batch), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 12, 16])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (16, 2, 1), (80, 1, 4)])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_16bit_cache_is_attention_over_its_fp32_widening(make_paged_batch, block_size, head_dim,
                                                         num_kv_heads, group, kv_dtype) -> None:
    # --kv-cache-dtype float16 / bfloat16: K (into its transposed copy) and each block's V are
    # widened once, then the fp32 code runs: the bits of an fp32 cache holding the widened values
    seqs = [(37, 37), (70, 21), (9, 2)]
    batch = make_paged_batch(seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim, dtype=torch.float32, device=torch.device("cpu"),
                             seed=23)
    half = dataclasses.replace(batch, kv=batch.kv.to(kv_dtype))
    widened = dataclasses.replace(batch, kv=half.kv.float())
    out = _direct(half)
    assert out.dtype == torch.float32 and torch.equal(out, _direct(widened))
    assert not torch.equal(out, _direct(batch))  # the 16-bit rounding shows
    torch.testing.assert_close(out, _ref(half), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_prompt_any_thread_count_same_bits(make_paged_batch, threads) -> None:
    # a 512-token chunk after 200 tokens of context, as a server's chunked prefill runs it
    batch = make_paged_batch([(712, 512)], block_size=16, num_kv_heads=3, group=3, head_dim=64,
                             dtype=torch.float32, device=torch.device("cpu"), seed=22)
    out = _direct(batch, threads)
    torch.testing.assert_close(out, _ref(batch), atol=1e-5, rtol=1e-5)
    assert torch.equal(out, _direct(batch, 1))  # work split over threads: the same bits


def _assert_within_bf16_rounding(batch, out: torch.Tensor) -> None:
    """`out` of bf16 products against attention over q, K, V rounded to bf16 (fp64): only the
    probabilities' rounding (2^-8 relative) and fp32 sums remain, within 2^-7 of the largest
    |v|."""
    rounded = dataclasses.replace(batch, q=batch.q.bfloat16().double(),
                                  kv=batch.kv.bfloat16().double())
    exact = paged_attention_ref(rounded.q, rounded.kv[0], rounded.kv[1], rounded.block_tables,
                                rounded.seq_lens, rounded.cu_seqlens_q, batch.scale)
    err = (out.double() - exact).abs().max().item()
    assert err <= 2.0 ** -7 * batch.kv[1].float().abs().max().item(), err


def _score_range(batch, seq: int = 0) -> float:
    """max - min of the first query head's scores over sequence `seq`'s context (last row)."""
    ctx = int(batch.seq_lens[seq])
    tables = batch.block_tables[seq].to(torch.int64).clamp(min=0)
    k = batch.kv[0][tables].reshape(-1, batch.kv.shape[3], batch.kv.shape[4])[:ctx, 0].float()
    row = int(batch.cu_seqlens_q[seq + 1]) - 1
    s = (k @ batch.q[row, 0].float()) * batch.scale
    return float(s.max() - s.min())


@needs_kernel
@pytest.mark.parametrize("bf16_dot", [False, True])
def test_sharp_scores_match_ref(make_paged_batch, bf16_dot) -> None:
    # keys that trail a row's max score by more than 87 (their exp below the smallest normal
    # float, where libmvec's vector exp leaves its fast path): probability 0, as in the
    # reference, and the other keys' as before (kernels/csrc/softmax_exp.h)
    if bf16_dot and not pac.bf16_dot_available():
        pytest.skip("no AVX512-BF16 here")
    batch = make_paged_batch([(700, 512), (37, 37)], block_size=16, num_kv_heads=2, group=3,
                             head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                             seed=27)
    batch = dataclasses.replace(batch, q=batch.q * 40)
    assert _score_range(batch) > 200
    out = _direct(batch, bf16_dot=bf16_dot)
    if not bf16_dot:
        torch.testing.assert_close(out, _ref(batch), atol=1e-4, rtol=1e-4)
        return
    _assert_within_bf16_rounding(batch, out)


@needs_kernel
def test_mixed_step_through_the_cpp_plan(make_paged_batch) -> None:
    # decodes between prefill chunks: both C++ kernels in one cpu_paged_attention call
    seqs = [(12, 1), (7, 7), (21, 5), (1, 1), (30, 13), (40, 1)]
    batch = make_paged_batch(seqs, block_size=8, num_kv_heads=2, group=3, head_dim=64,
                             dtype=torch.float32, device=torch.device("cpu"), seed=23)
    cu = batch.cu_seqlens_q.tolist()
    plan = plan_cpu_attention([b - a for a, b in zip(cu, cu[1:])], batch.seq_lens.tolist(),
                              batch.block_tables, 8, 2 * 2 * 64 * 4, decode_kernel="cpp")
    assert plan.prefill_kernel and len(plan.prefills) == 3
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan, batch.scale)
    torch.testing.assert_close(out, _ref(batch), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_strided_q_and_out_rows(make_paged_batch) -> None:
    batch = make_paged_batch([(50, 20)], block_size=16, num_kv_heads=2, group=3, head_dim=64,
                             dtype=torch.float32, device=torch.device("cpu"), seed=24)
    wide = torch.cat([batch.q, torch.randn(batch.q.shape[0], 4, 64)], dim=1)  # a fused projection
    q = wide[:, :6]
    out_wide = torch.full((20, 8, 64), 7.0)
    out = out_wide[:, :6]
    pac.prefill_attention_cpu(q, batch.kv[0], batch.kv[1], batch.block_tables[0].to(torch.int64),
                              50, out, batch.scale)
    torch.testing.assert_close(out, _ref(batch), atol=1e-5, rtol=1e-5)
    assert torch.equal(out_wide[:, 6:], torch.full((20, 2, 64), 7.0))


@needs_kernel
def test_checks() -> None:
    q = torch.randn(4, 6, 64)
    cache = torch.randn(4, 8, 2, 64)
    out = torch.full_like(q, 7.0)
    blocks = torch.tensor([0, 1])
    pac.prefill_attention_cpu(q, cache, cache, blocks, 10, out, 0.125)  # valid
    assert torch.isfinite(out).all() and not torch.equal(out, torch.full_like(q, 7.0))
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="ctx_len"):
        pac.prefill_attention_cpu(q, cache, cache, blocks, 3, out, 0.125)  # 4 rows, context 3
    with pytest.raises(ValueError, match="cover"):
        pac.prefill_attention_cpu(q, cache, cache, blocks, 17, out, 0.125)  # 17 needs 3 blocks
    with pytest.raises(ValueError, match="outside the cache"):
        pac.prefill_attention_cpu(q, cache, cache, torch.tensor([0, 4]), 10, out, 0.125)
    with pytest.raises(ValueError, match="float32"):
        pac.prefill_attention_cpu(q.double(), cache, cache, blocks, 10, out, 0.125)
    with pytest.raises(ValueError, match="int64"):
        pac.prefill_attention_cpu(q, cache, cache, blocks.int(), 10, out, 0.125)
    with pytest.raises(ValueError, match="both caches alike"):
        pac.prefill_attention_cpu(q, cache, cache.half(), blocks, 10, out, 0.125)
    with pytest.raises(ValueError, match="both caches alike"):
        pac.prefill_attention_cpu(q, cache.bfloat16(), cache.half(), blocks, 10, out, 0.125)
    big = torch.randn(2, 80, 2, 64)
    with pytest.raises(ValueError, match="block_size"):
        pac.prefill_attention_cpu(q, big, big, torch.tensor([0]), 10, out, 0.125)
    assert torch.equal(out, torch.full_like(q, 7.0))  # the refused calls wrote nothing
    assert not pac.supports(torch.float32, 6, 2, 64, 128)
    assert pac.supports(torch.float32, 6, 2, 64, 16, torch.float16)
    assert pac.supports(torch.float32, 6, 2, 64, 16, torch.bfloat16)
    assert not pac.supports(torch.float32, 6, 2, 64, 16, torch.float64)


needs_bf16 = pytest.mark.skipif(not pac.bf16_dot_available(),
                                reason="no AVX512-BF16 here (or an ISA cap hides it)")


def test_bf16_run_check_agrees_with_the_build() -> None:
    # the run check (CPU flags, under any ISA cap) and the build (-march=native with that cap's
    # flags) say the same: a capped or older CPU never gets a build with the bf16 path
    if pac.build_problem() is not None:
        assert not pac.bf16_dot_available()
        return
    from kernels.cpu_build import cpu_flags

    has = bool(pac.LIBRARY.load().conveyor_prefill_attention_bf16_dot())
    assert has == ("avx512_bf16" in cpu_flags()) == pac.bf16_dot_available()


@needs_bf16
@pytest.mark.parametrize("block_size", [8, 12, 16, 32, 64])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (16, 2, 1), (80, 1, 4),
                                                         (128, 2, 2)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bf16_dot_within_its_bound(make_paged_batch, block_size, head_dim, num_kv_heads, group,
                                   kv_dtype) -> None:
    seqs = [(37, 37), (70, 21), (64, 16), (9, 2), (150, 33)]
    batch = make_paged_batch(seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim, dtype=torch.float32, device=torch.device("cpu"),
                             seed=25)
    batch = dataclasses.replace(batch, kv=batch.kv.to(kv_dtype))
    out = _direct(batch, bf16_dot=True)
    torch.testing.assert_close(out, _ref(batch), atol=pac.BF16_DOT_BOUND, rtol=pac.BF16_DOT_BOUND)
    assert not torch.equal(out, _direct(batch))  # the bf16 products ran
    _assert_within_bf16_rounding(batch, out)


@needs_bf16
def test_bf16_dot_constant_v_comes_back(make_paged_batch) -> None:
    # the running sum adds the rounded probabilities: an output row is a convex combination of
    # the V rows it sees, so a V that is one bf16 vector everywhere comes back (fp32 sums only)
    batch = make_paged_batch([(300, 200), (40, 40)], block_size=16, num_kv_heads=2, group=3,
                             head_dim=64, dtype=torch.float32, device=torch.device("cpu"), seed=26)
    row = torch.randn(64).bfloat16().float()
    kv = batch.kv.clone()
    kv[1] = row
    out = _direct(dataclasses.replace(batch, kv=kv), bf16_dot=True)
    torch.testing.assert_close(out, row.expand_as(out), atol=1e-6, rtol=1e-6)


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16_dot_any_thread_count_same_bits(make_paged_batch, threads) -> None:
    batch = make_paged_batch([(1300, 512)], block_size=16, num_kv_heads=3, group=3, head_dim=64,
                             dtype=torch.float32, device=torch.device("cpu"), seed=27)
    out = _direct(batch, threads, bf16_dot=True)
    torch.testing.assert_close(out, _ref(batch), atol=pac.BF16_DOT_BOUND, rtol=pac.BF16_DOT_BOUND)
    assert torch.equal(out, _direct(batch, 1, bf16_dot=True))


@needs_bf16
def test_bf16_dot_through_the_cpp_plan(make_paged_batch) -> None:
    # decodes, short chunks and one chunk whose context reaches BF16_DOT_MIN_CONTEXT: only that
    # one takes the bf16 products; the rest keep the fp32 kernels' bits
    long_ctx = pac.BF16_DOT_MIN_CONTEXT + 37
    seqs = [(12, 1), (7, 7), (21, 5), (long_ctx, 40), (1, 1), (30, 13), (40, 1)]
    batch = make_paged_batch(seqs, block_size=16, num_kv_heads=2, group=3, head_dim=64,
                             dtype=torch.float32, device=torch.device("cpu"), seed=28)
    cu = batch.cu_seqlens_q.tolist()
    args = ([b - a for a, b in zip(cu, cu[1:])], batch.seq_lens.tolist(), batch.block_tables, 16,
            2 * 2 * 64 * 4)
    plan = plan_cpu_attention(*args, decode_kernel="cpp", prefill_bf16_dot=True)
    assert plan.prefill_bf16_dot
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan, batch.scale)
    torch.testing.assert_close(out, _ref(batch), atol=pac.BF16_DOT_BOUND, rtol=pac.BF16_DOT_BOUND)
    fp32 = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1],
                               plan_cpu_attention(*args, decode_kernel="cpp"), batch.scale)
    long_rows = slice(cu[3], cu[4])
    short = torch.ones(out.shape[0], dtype=torch.bool)
    short[long_rows] = False
    assert torch.equal(out[short], fp32[short])  # decodes and short chunks: fp32 products
    assert not torch.equal(out[long_rows], fp32[long_rows])
    with pytest.raises(ValueError, match="need decode_kernel 'cpp'"):
        plan_cpu_attention(*args, prefill_bf16_dot=True)


def test_bf16_dot_refused_without_the_instructions(monkeypatch) -> None:
    monkeypatch.setattr(pac, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not pac.bf16_dot_available()
    q = torch.randn(4, 6, 64)
    cache = torch.randn(4, 8, 2, 64)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        pac.prefill_attention_cpu(q, cache, cache, torch.tensor([0, 1]), 10, out, 0.125,
                                  bf16_dot=True)
    assert torch.equal(out, torch.full_like(q, 7.0))
