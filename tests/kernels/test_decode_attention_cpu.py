"""The C++ decode attention kernel (kernels.decode_attention_cpu) against paged_attention_ref
and the naive loop, through cpu_paged_attention's "cpp" plan and called directly; its
argument checks; building it (cache, compiler missing, compile errors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import decode_attention_cpu as dac
from kernels import paged_attention_ref
from kernels.paged_attention_cpu import cpu_paged_attention, plan_cpu_attention

SCENARIOS = {
    # (context incl. this step, query tokens): contexts end mid-block and on a block edge
    "decode": [(5, 1), (16, 1), (1, 1), (23, 1), (40, 1)],
    # decodes between prefill chunks (rows not consecutive), chunks with earlier context
    "mixed": [(12, 1), (7, 7), (21, 5), (1, 1), (30, 13), (9, 2), (40, 1)],
}

needs_kernel = pytest.mark.skipif(
    not dac.kernel_available(), reason=f"C++ kernel does not build here: {dac.build_problem()}")


def _plan(batch):
    cu = batch.cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    num_kv_heads, head_dim = batch.kv.shape[3], batch.kv.shape[4]
    return plan_cpu_attention(q_lens, batch.seq_lens.tolist(), batch.block_tables,
                              batch.kv.shape[2], 2 * num_kv_heads * head_dim * 4,
                              decode_kernel="cpp")


@needs_kernel
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_matches_ref_and_naive(make_paged_batch, naive_attention, scenario, group, block_size,
                               head_dim) -> None:
    batch = make_paged_batch(SCENARIOS[scenario], block_size=block_size, num_kv_heads=2,
                             group=group, head_dim=head_dim, dtype=torch.float32,
                             device=torch.device("cpu"), seed=11)
    plan = _plan(batch)
    assert plan.kernel_decodes is not None and plan.decode_groups == ()
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan, batch.scale)
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if head_dim == 16:  # the naive loop is slow
        torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("head_dim,group", [(16, 1), (64, 3), (80, 4)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_16bit_cache_is_attention_over_its_fp32_widening(make_paged_batch, scenario, head_dim,
                                                         group, threads, kv_dtype) -> None:
    # --kv-cache-dtype float16 / bfloat16: both C++ kernels (decode rows, and the mixed
    # scenario's prefill chunks) widen each value to fp32 as they load it and then do what they do
    # over an fp32 cache: the output is that over the widened cache, up to the compiler's
    # FMA contraction, which may differ between the two builds of a loop (one ulp seen).
    batch = make_paged_batch(SCENARIOS[scenario], block_size=8, num_kv_heads=2, group=group,
                             head_dim=head_dim, dtype=torch.float32,
                             device=torch.device("cpu"), seed=13)
    k16, v16 = batch.kv[0].to(kv_dtype), batch.kv[1].to(kv_dtype)
    plan = _plan(batch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out16 = cpu_paged_attention(batch.q, k16, v16, plan, batch.scale)
        out32 = cpu_paged_attention(batch.q, k16.float(), v16.float(), plan, batch.scale)
    finally:
        torch.set_num_threads(before)
    assert out16.dtype == torch.float32
    torch.testing.assert_close(out16, out32, atol=1e-6, rtol=1e-6)
    ref = paged_attention_ref(batch.q, k16, v16, batch.block_tables, batch.seq_lens,
                              batch.cu_seqlens_q, batch.scale)
    torch.testing.assert_close(out16, ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out16, cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan,
                                                      batch.scale))  # fp16 rounding shows


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_and_many_heads(make_paged_batch, threads) -> None:
    # 4 KV heads x G 4: work items split heads when there are few sequences
    batch = make_paged_batch([(33, 1), (70, 1)], block_size=16, num_kv_heads=4, group=4,
                             head_dim=32, dtype=torch.float32, device=torch.device("cpu"),
                             seed=12)
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], _plan(batch), batch.scale)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_sharp_scores_match_ref(make_paged_batch) -> None:
    # scores spread over hundreds: keys 87 or more below a row's max get probability 0 (as in
    # the reference), without libmvec's scalar path (kernels/csrc/softmax_exp.h)
    batch = make_paged_batch([(300, 1), (40, 1), (1, 1)], block_size=16, num_kv_heads=2,
                             group=3, head_dim=64, dtype=torch.float32,
                             device=torch.device("cpu"), seed=13)
    batch = dataclasses.replace(batch, q=batch.q * 40)
    k = batch.kv[0][batch.block_tables[0].to(torch.int64)].reshape(-1, 2, 64)[:300, 0]
    s = (k @ batch.q[0, 0]) * batch.scale
    assert float(s.max() - s.min()) > 200
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], _plan(batch), batch.scale)
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_direct_call_strided_q_writes_only_its_rows(make_paged_batch) -> None:
    batch = make_paged_batch(SCENARIOS["decode"], block_size=8, num_kv_heads=2, group=3,
                             head_dim=64, dtype=torch.float32, device=torch.device("cpu"), seed=13)
    # q as the model hands it: rows of a wider fused projection
    wide = torch.cat([batch.q, torch.randn(batch.q.shape[0], 4, 64)], dim=1)
    q = wide[:, :6]
    assert not q.is_contiguous()
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    pick = torch.tensor([3, 0, 4])  # decodes 3, 0, 4 only, out of order
    out = torch.full_like(batch.q, 7.0)
    dac.decode_attention_cpu(q, batch.kv[0], batch.kv[1],
                             batch.block_tables.to(torch.int64)[pick].clamp(min=0),
                             batch.seq_lens.to(torch.int64)[pick], pick, out, batch.scale)
    torch.testing.assert_close(out[pick], ref[pick], atol=1e-5, rtol=1e-5)
    untouched = torch.tensor([1, 2])
    assert torch.equal(out[untouched], torch.full_like(out[untouched], 7.0))


@needs_kernel
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(80, 2, 3), (96, 1, 7), (256, 2, 2),
                                                         (32, 1, 64), (128, 5, 1)])
def test_other_head_layouts_and_long_contexts(make_paged_batch, head_dim, num_kv_heads,
                                              group) -> None:
    # contexts of several hundred tokens over block size 16, ending mid-block; G up to 64
    batch = make_paged_batch([(700, 1), (333, 1), (17, 1)], block_size=16,
                             num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                             dtype=torch.float32, device=torch.device("cpu"), seed=14)
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], _plan(batch), batch.scale)
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_checks_lengths_rows_and_block_ids() -> None:
    q = torch.randn(3, 6, 64)
    cache = torch.randn(4, 8, 2, 64)
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([9, 16])
    rows = torch.tensor([0, 2])
    call = dac.decode_attention_cpu
    out = torch.full_like(q, 7.0)
    call(q, cache, cache, tables, lens, rows, out, 0.125)  # valid: fine
    for bad_lens, match in ((torch.tensor([0, 16]), "seq_lens"),
                            (torch.tensor([9, 17]), "seq_lens")):  # 17 tokens need 3 blocks
        with pytest.raises(ValueError, match=match):
            call(q, cache, cache, tables, bad_lens, rows, out, 0.125)
    for bad_rows in (torch.tensor([0, 3]), torch.tensor([-1, 0]), torch.tensor([2, 2])):
        with pytest.raises(ValueError, match="rows"):
            call(q, cache, cache, tables, lens, bad_rows, out, 0.125)
    with pytest.raises(ValueError, match="block id"):
        call(q, cache, cache, torch.tensor([[0, 4], [2, 3]]), lens, rows, out, 0.125)
    # block ids past a context's blocks are never read: anything is allowed there
    call(q, cache, cache, torch.tensor([[0, 1], [2, 3]]), torch.tensor([8, 16]), rows, out, 0.125)
    clean = torch.full_like(q, 7.0)
    with pytest.raises(ValueError):
        call(q, cache, cache, tables, torch.tensor([9, 0]), rows, clean, 0.125)
    assert torch.equal(clean, torch.full_like(q, 7.0))  # nothing written on an error


def test_bad_input_raises() -> None:
    q = torch.zeros(2, 6, 64)
    cache = torch.zeros(4, 8, 2, 64)
    tables = torch.zeros(2, 2, dtype=torch.int64)
    lens = torch.tensor([3, 5])
    rows = torch.arange(2)
    out = torch.empty_like(q)
    call = dac.decode_attention_cpu
    with pytest.raises(ValueError, match="float32"):
        call(q.double(), cache, cache, tables, lens, rows, out, 1.0)
    with pytest.raises(ValueError, match="int64"):
        call(q, cache, cache, tables.int(), lens, rows, out, 1.0)
    with pytest.raises(ValueError, match="same D"):
        call(torch.zeros(2, 6, 24), torch.zeros(4, 8, 2, 24), torch.zeros(4, 8, 2, 24), tables,
             lens, rows, torch.zeros(2, 6, 24), 1.0)  # head dim 24 has no kernel
    with pytest.raises(ValueError, match="same D"):
        call(torch.zeros(2, 5, 64), cache, cache, tables, lens, rows, torch.zeros(2, 5, 64), 1.0)
    with pytest.raises(ValueError, match="shape"):
        call(q, cache, cache, tables, lens, rows, torch.empty(3, 6, 64), 1.0)
    with pytest.raises(ValueError, match="describe n"):
        call(q, cache, cache, tables, lens[:1], rows, out, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(4, 8, 2, 128)[..., ::2]  # cache shape, not contiguous
        call(q, strided, strided, tables, lens, rows, out, 1.0)
    with pytest.raises(ValueError, match="decode_kernel"):
        plan_cpu_attention([1], [3], tables[:1], 8, 8, decode_kernel="fast")
    with pytest.raises(ValueError, match="both caches alike"):
        call(q, cache, cache.half(), tables, lens, rows, out, 1.0)
    with pytest.raises(ValueError, match="both caches alike"):
        call(q, cache.bfloat16(), cache.half(), tables, lens, rows, out, 1.0)
    with pytest.raises(ValueError, match="both caches alike"):
        call(q, cache.double(), cache.double(), tables, lens, rows, out, 1.0)


def test_supports() -> None:
    assert dac.supports(torch.float32, 9, 3, 64)
    assert not dac.supports(torch.bfloat16, 9, 3, 64)
    assert not dac.supports(torch.float32, 9, 3, 24)
    assert not dac.supports(torch.float32, 8, 3, 64)
    assert dac.supports(torch.float32, 9, 3, 64, torch.float16)
    assert dac.supports(torch.float32, 9, 3, 64, torch.bfloat16)
    assert not dac.supports(torch.float32, 9, 3, 64, torch.float64)
    assert not dac.supports(torch.float16, 9, 3, 64, torch.float16)  # fp32 activations only


@needs_kernel
def test_loading_keeps_denormals(tmp_path) -> None:
    # -ffast-math at link time would add crtfastmath.o, which turns on flush-to-zero for the
    # whole process when the library loads: torch's numerics would change with it.
    import subprocess
    import sys

    code = ("from kernels import decode_attention_cpu as d; d.load_kernel(); "
            "import torch; x = float('5e-324'); "
            "assert x * float('1') != 0.0, 'DAZ set'; "
            "t = torch.tensor([1e-40]); assert (t * 1.0).item() != 0.0, 'FTZ set'")
    env = {**__import__("os").environ, "CONVEYOR_CACHE_DIR": str(tmp_path)}  # a fresh build
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
