"""cpu_paged_attention (planned once per step, decodes in cache-sized groups) against
paged_attention_ref and the naive loop; the plan's exact layout; bad input."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention_ref
from kernels.paged_attention_cpu import cpu_paged_attention, plan_cpu_attention

SCENARIOS = {
    "decode": [(5, 1), (16, 1), (1, 1), (23, 1)],
    "prefill": [(9, 9), (3, 3), (17, 17)],
    "mixed": [(12, 1), (7, 7), (21, 5), (1, 1), (30, 13), (9, 2), (40, 1)],
}


def _plan(batch, group_bytes: int):
    cu = batch.cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    num_kv_heads, head_dim = batch.kv.shape[3], batch.kv.shape[4]
    return plan_cpu_attention(q_lens, batch.seq_lens.tolist(), batch.block_tables,
                              batch.kv.shape[2], 2 * num_kv_heads * head_dim * 4, group_bytes)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group_bytes", [1, 1 << 20])  # one sequence per group / all in one
def test_matches_ref_and_naive(make_paged_batch, naive_attention, scenario, group, block_size,
                               group_bytes) -> None:
    batch = make_paged_batch(SCENARIOS[scenario], block_size=block_size, num_kv_heads=2,
                             group=group, head_dim=16, dtype=torch.float32,
                             device=torch.device("cpu"), seed=5)
    plan = _plan(batch, group_bytes)
    out = cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan, batch.scale)
    ref = paged_attention_ref(batch.q, batch.kv[0], batch.kv[1], batch.block_tables,
                              batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_strided_q_view_of_fused_projection(make_paged_batch) -> None:
    # the model hands q as rows of a [T, Hq + Hkv, D] rotary output: not contiguous
    batch = make_paged_batch(SCENARIOS["mixed"], block_size=8, num_kv_heads=2, group=3,
                             head_dim=16, dtype=torch.float32, device=torch.device("cpu"), seed=6)
    wide = torch.cat([batch.q, torch.randn(batch.q.shape[0], 2, 16)], dim=1)
    q = wide[:, :6]
    assert not q.is_contiguous()
    plan = _plan(batch, 1 << 20)
    torch.testing.assert_close(cpu_paged_attention(q, batch.kv[0], batch.kv[1], plan, batch.scale),
                               cpu_paged_attention(batch.q, batch.kv[0], batch.kv[1], plan,
                                                   batch.scale))


def test_plan_layout() -> None:
    # rows: seq 0 decode (row 0), seq 1 prefill of 3 from position 0 (rows 1-3),
    # seq 2 decode (row 4), seq 3 chunk of 2 after 3 earlier tokens (rows 5-6)
    tables = torch.tensor([[4, 9, -1], [2, -1, -1], [7, 1, 3], [5, 6, -1]], dtype=torch.int32)
    bytes_per_token = 2 * 2 * 8 * 4
    plan = plan_cpu_attention([1, 3, 1, 2], [6, 3, 9, 5], tables, 4, bytes_per_token, 1 << 20)
    assert plan.num_tokens == 7 and not plan.all_decode_in_order
    (g,) = plan.decode_groups  # both decodes fit one group
    assert torch.equal(g.rows, torch.tensor([0, 4]))  # not consecutive: an index
    assert g.num_blocks == 3  # the longer context, 9 tokens
    # row-major [2, 3] block ids; the -1 padding of sequence 0 is read as block 0
    assert g.blocks.tolist() == [4, 9, 0, 7, 1, 3]
    assert g.mask is not None and g.mask.shape == (2, 1, 1, 12)
    assert g.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 6
    assert g.mask[1, 0, 0].tolist() == [True] * 9 + [False] * 3
    first, second = plan.prefills
    assert first.rows == slice(1, 4) and first.blocks.tolist() == [2] and first.mask is None
    assert second.rows == slice(5, 7) and second.blocks.tolist() == [5, 6]
    assert second.ctx_len == 5 and second.mask is not None
    # query 0 is position 3 (keys 0..3), query 1 position 4 (keys 0..4)
    assert second.mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]


def test_decode_groups_split_by_bytes_and_pad_to_their_own_longest() -> None:
    tables = torch.arange(12, dtype=torch.int64).view(4, 3)
    per_token = 10
    # contexts 4, 4, 12, 4 (block size 4): a budget of 100 bytes = 10 tokens per group
    plan = plan_cpu_attention([1, 1, 1, 1], [4, 4, 12, 4], tables, 4, per_token, 100)
    groups = plan.decode_groups
    assert [(g.rows, g.num_blocks) for g in groups] == [
        (slice(0, 2), 1), (slice(2, 3), 3), (slice(3, 4), 1)]
    assert groups[0].mask is None  # both fill their one block exactly
    assert groups[1].blocks.tolist() == [6, 7, 8]
    one = plan_cpu_attention([1, 1], [4, 4], tables[:2], 4, per_token, 1 << 20)
    assert one.all_decode_in_order and one.decode_groups[0].rows == slice(0, 2)


def test_bad_input_raises() -> None:
    tables = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="query tokens"):
        plan_cpu_attention([3, 1], [2, 5], tables, 4, 8)
    with pytest.raises(ValueError, match="columns"):
        plan_cpu_attention([1, 1], [9, 5], tables, 4, 8)  # 9 tokens need 3 blocks
    with pytest.raises(ValueError, match="same sequences"):
        plan_cpu_attention([1], [5, 5], tables, 4, 8)
    plan = plan_cpu_attention([1, 1], [5, 5], tables, 4, 8)
    kv = torch.zeros(2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="rows"):
        cpu_paged_attention(torch.zeros(3, 2, 8), kv[0], kv[1], plan, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        cpu_paged_attention(torch.zeros(2, 3, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                            plan, 1.0)
