"""Paged attention over a flattened batch of prefill chunks and decodes.

Layout (PagedAttention, Kwon et al., SOSP 2023): the KV cache of one layer is
``[2, num_blocks, block_size, Hkv, D]``; ``k_cache = kv[0]``, ``v_cache = kv[1]``.
Sequence ``b`` owns the blocks ``block_tables[b, :ceil(seq_lens[b] / block_size)]``
in order; token position ``p`` of that sequence lives at
``block_tables[b, p // block_size]``, row ``p % block_size``.

The batch is flattened: the queries of sequence ``b`` are the rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q``. A sequence with one query
row is a decode; with more, a prefill chunk, possibly after earlier context::

    sequence b, seq_lens[b] = 11, n_b = 3 query tokens
    positions  0 1 2 3 4 5 6 7 | 8 9 10
               earlier context | this step's chunk (already in the cache)
    query j = 0, 1, 2 sits at position 8 + j and attends to positions 0..8 + j

Two implementations with one signature:

- ``paged_attention_ref`` (``kernels.paged_attention_ref``): torch
  ``scaled_dot_product_attention`` over gathered K/V, the reference (all decodes in one
  call, one call per prefill chunk). The CPU serves through ``kernels.paged_attention_cpu``.
- ``paged_attention``: one Triton launch for the whole batch (see the kernel's
  docstring for the grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton.language as tl
except ImportError:  # triton is optional: the torch reference needs none of it
    tl = None  # type: ignore[assignment]

from kernels import _triton
from kernels.paged_attention_ref import _check_attention_args, paged_attention_ref

__all__ = ["AttentionWork", "paged_attention", "paged_attention_ref", "plan_attention_work"]


def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    work_seq_ptr,
    work_tile_ptr,
    scale_log2,
    q_tok_stride,
    q_head_stride,
    out_tok_stride,
    out_head_stride,
    cache_block_stride,
    cache_row_stride,
    cache_head_stride,
    block_table_stride,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    # IEEE: both matmuls in fp32 without TF32. Used for fp32 inputs, and for
    # bf16 under the interpreter, whose tl.dot multiplies bf16 bit patterns
    # (triton-lang/triton#11584).
    # grid: (num_work_items, Hkv). Work item w is query tile work_tile[w] of
    # sequence work_seq[w]; a tile holds BLOCK_Q = BLOCK_M // GROUP query
    # tokens times the GROUP query heads of kv head `kvh`, one row each:
    #   row r -> token tile * BLOCK_Q + r // GROUP, query head kvh * GROUP + r % GROUP
    # E.g. GROUP 3, BLOCK_M 16: BLOCK_Q 5, rows 0..14 used, row 15 idle; a
    # decode is one tile with rows 0..2 used, so it never pays for a prefill's
    # tile count (only, in a mixed step, for its larger tile). Every K/V block is loaded once per (tile, kv head).
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    work = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(work_seq_ptr + work)
    tile = tl.load(work_tile_ptr + work)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP  # token index within the chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    query_pos = ctx_len - q_len + tok  # this row's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_off = (q_start + tok).to(tl.int64)[:, None] * q_tok_stride + head[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys this tile can see: 0 .. position of its last token (at most ctx_len - 1).
    last_tok = tl.minimum(q_len, (tile + 1) * BLOCK_Q) - 1
    kv_end = ctx_len - q_len + last_tok + 1
    table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for kv_start in range(0, kv_end, BLOCK_N):
        keys = kv_start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block_ids = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = block_ids * cache_block_stride + (keys % BLOCK_SIZE) * cache_row_stride + kvh * cache_head_stride
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # a cache dtype other than q's: as q's
        s = s * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (keys[None, :] <= query_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first block on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64)[:, None] * out_tok_stride + head[:, None] * out_head_stride + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # keys per inner iteration; a tile may span several cache blocks


@dataclass(frozen=True)
class AttentionWork:
    """The grid of one ``paged_attention`` launch, planned on the host.

    Build it once per step with ``plan_attention_work`` (cu_seqlens_q is
    known on the host when the batch is built) and pass it to every layer's
    call: the kernel then needs no host sync. Without it, each call copies
    cu_seqlens_q to the host.

    Fields:
        work_seq, work_tile: [W] int32 on the kernel's device; program w
            handles query tile work_tile[w] of sequence work_seq[w].
        block_m: rows per tile (query tokens x GQA group), a power of two.
        group: query heads per kv head the plan was made for.
    """

    work_seq: torch.Tensor
    work_tile: torch.Tensor
    block_m: int
    group: int


def plan_attention_work(
    cu_seqlens_q: torch.Tensor | list[int], num_q_heads: int, num_kv_heads: int, device: torch.device | str
) -> AttentionWork:
    """Map grid programs to (sequence, query tile) for ``paged_attention``.

    Args:
        cu_seqlens_q: [B + 1] query start offsets, preferably on the CPU (a
            CUDA tensor is copied to the host: one sync).
        num_q_heads, num_kv_heads: Hq and Hkv (Hq a multiple of Hkv).
        device: where the kernel runs.

    Returns:
        An ``AttentionWork``. Tiles have 16 rows when every chunk fits one
        (max query length x group <= 16), else 64. E.g. query lengths
        [1, 30, 0, 1] with group 3: 64-row tiles hold 21 tokens -> tiles per
        sequence [1, 2, 0, 1] -> work_seq [0, 1, 1, 3], work_tile [0, 0, 1, 0].
        Sequences with no query token get no work item.

    Raises:
        ValueError: Hq not a multiple of Hkv, or cu_seqlens_q not 1-D.
    """
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    cu = torch.as_tensor(cu_seqlens_q).to("cpu", torch.int64)
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be [B + 1], got shape {tuple(cu.shape)}")
    group = num_q_heads // num_kv_heads
    q_lens = cu[1:] - cu[:-1]  # [B]
    max_q_len = int(q_lens.max()) if q_lens.numel() else 0
    # Decode-only steps use the smallest tile tl.dot allows; prefill larger ones.
    block_m = max(16 if max_q_len * group <= 16 else 64, _triton.next_power_of_2(group))
    tokens_per_tile = block_m // group
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile  # [B]
    work_seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), tiles)  # [W]
    first = torch.cumsum(tiles, 0) - tiles  # first work item of each sequence
    work_tile = torch.arange(work_seq.shape[0]) - first[work_seq]
    return AttentionWork(
        work_seq=work_seq.to(device=device, dtype=torch.int32),
        work_tile=work_tile.to(device=device, dtype=torch.int32),
        block_m=block_m,
        group=group,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    work: AttentionWork | None = None,
) -> torch.Tensor:
    """Causal paged attention over mixed prefill chunks and decodes, one Triton launch.

    Same contract as ``paged_attention_ref`` (shapes, dtypes, result). q may
    be a strided view (unit stride in D). Entries of block_tables past a
    sequence's last block are never read. Online softmax (Milakov & Gimelshein
    2018; FlashAttention, Dao et al. 2022) in fp32; fp32 inputs use IEEE
    matmuls (no TF32).

    work: the grid plan from ``plan_attention_work`` for this cu_seqlens_q;
    when None it is built here, costing one host sync per call. seq_lens is
    not checked against cu_seqlens_q on the device: a chunk longer than its
    context is undefined behaviour.

    Raises:
        ValueError: as ``paged_attention_ref``, plus non-unit last strides,
            a non-contiguous block_tables row, a head dim > 256, or a work
            plan made for another GQA group or device.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    if q.stride(2) != 1:
        raise ValueError(f"q must have unit stride in its last dimension, shape {tuple(q.shape)} strides {q.stride()}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            f"k_cache and v_cache need equal strides with a unit last stride, got "
            f"{k_cache.stride()} and {v_cache.stride()} (shape {tuple(k_cache.shape)})"
        )
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, shape {tuple(block_tables.shape)} strides {block_tables.stride()}")
    tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim > 256:
        raise ValueError(f"head dim {head_dim} > 256 is not supported (q shape {tuple(q.shape)})")
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if tokens == 0 or block_tables.shape[0] == 0:
        return out
    if work is None:
        work = plan_attention_work(cu_seqlens_q, num_q_heads, num_kv_heads, q.device)
    if work.group != num_q_heads // num_kv_heads or work.work_seq.device != q.device:
        raise ValueError(
            f"work plan is for group {work.group} on {work.work_seq.device}, "
            f"but q/k_cache give group {num_q_heads // num_kv_heads} on {q.device}"
        )
    if work.work_seq.shape[0] == 0:
        return out
    grid = (work.work_seq.shape[0], num_kv_heads)
    _triton.jit(_paged_attention_kernel)[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        work.work_seq,
        work.work_tile,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=work.block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, _triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _triton.interpret_enabled()),
    )
    return out
