"""Paged attention's torch reference: ``scaled_dot_product_attention`` over gathered K/V.

The contract (layout, flattened batch, causal masking) is in ``kernels.paged_attention``'s
docstring; the Triton kernel there is tested against this function. Production on the CPU
is ``kernels.paged_attention_cpu`` (planned once per step, our C++ decode kernel), which
this reference checks too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> None:
    """Shape and dtype checks shared by both implementations (no host sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache head_dim {k_cache.shape[3]} differs from q head_dim {head_dim} "
            f"(k_cache shape {tuple(k_cache.shape)}, q shape {tuple(q.shape)})"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q heads ({num_q_heads}, q shape {tuple(q.shape)}) must be a multiple of "
            f"kv heads ({num_kv_heads}, k_cache shape {tuple(k_cache.shape)})"
        )
    if v_cache.dtype != k_cache.dtype or not k_cache.dtype.is_floating_point:
        raise ValueError(
            f"k_cache, v_cache dtypes differ or are not floating point: {k_cache.dtype}, "
            f"{v_cache.dtype} (q {q.dtype})"
        )
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [B, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    batch = block_tables.shape[0]
    if seq_lens.shape != (batch,):
        raise ValueError(
            f"seq_lens must be [B] with B = {batch} (block_tables rows), got shape {tuple(seq_lens.shape)}"
        )
    if cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(
            f"cu_seqlens_q must be [B + 1] with B = {batch}, got shape {tuple(cu_seqlens_q.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype} (shape {tuple(t.shape)})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"k_cache/v_cache on {k_cache.device}/{v_cache.device}, q on {q.device}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    work: object | None = None,
) -> torch.Tensor:
    """Causal paged attention with torch SDPA (the reference of the Triton and CPU paths).

    Args:
        q: [T, Hq, D] queries of every sequence, flattened.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], one floating dtype: q's, or
            another (a 16-bit cache: read as q's dtype);
            this step's K/V must already be stored (see ``store_kv``). Slots
            past a sequence's context are gathered then masked, so they must
            be finite (allocate the cache with zeros, not empty: a NaN there
            leaks through the masked product). The Triton kernel never reads them.
        block_tables: [B, max_blocks] int32 (or int64) block ids; entries past
            a sequence's last block are ignored (clamped, then masked out).
        seq_lens: [B] int32 (or int64) context length of each sequence, this step's
            query tokens included.
        cu_seqlens_q: [B + 1] int32 query start offsets, cu_seqlens_q[0] == 0,
            cu_seqlens_q[B] == T.
        scale: softmax scale, usually D ** -0.5.
        work: accepted for a signature uniform with ``paged_attention``; ignored.

    Returns:
        [T, Hq, D] in q's dtype. Rows of q not covered by cu_seqlens_q are 0.

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, or a sequence whose
            chunk is longer than its context.

    Decodes (one query token) go through ONE batched SDPA call: their K/V are
    gathered through the block tables into [B_dec, Hkv, L_max, D] with a
    boolean key-padding mask, GQA left to ``enable_gqa=True`` (no expansion).
    Each prefill chunk is one SDPA call with a causal mask offset by its
    earlier context (``is_causal`` when there is none).
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    device = q.device
    tables = block_tables.clamp(0, num_blocks - 1)  # padding entries may hold anything

    decode_seqs: list[int] = []
    for b, ctx_len in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if n < 0 or n > ctx_len:
            raise ValueError(
                f"sequence {b}: {n} query tokens (cu_seqlens_q) but context length {ctx_len} (seq_lens)"
            )
        if n == 0:
            continue
        if n == 1:
            decode_seqs.append(b)
            continue
        # Prefill chunk: keys 0..ctx_len-1, query j at position ctx_len - n + j.
        num_seq_blocks = -(-ctx_len // block_size)
        blocks = tables[b, :num_seq_blocks]
        k = k_cache.index_select(0, blocks).to(q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]  # [L, Hkv, D]
        v = v_cache.index_select(0, blocks).to(q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
        qc = q[cu[b] : cu[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        start = ctx_len - n
        if start == 0:
            mask = None
        else:
            # E.g. ctx_len 5, n 2: query 0 (position 3) sees keys 0..3, query 1 sees 0..4.
            key_pos = torch.arange(ctx_len, device=device)
            query_pos = torch.arange(start, ctx_len, device=device)
            mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # [1, 1, n, L]
        o = F.scaled_dot_product_attention(
            qc,
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
        out[cu[b] : cu[b + 1]] = o[0].transpose(0, 1)

    if decode_seqs:
        n_dec = len(decode_seqs)
        max_len = max(lens[b] for b in decode_seqs)
        num_dec_blocks = -(-max_len // block_size)
        every_seq_decodes = n_dec == len(lens)  # then q rows cu[0]..cu[0]+B-1, in order
        if every_seq_decodes:
            rows = tables[:, :num_dec_blocks]  # [B_dec, nblk]
            dec_lens = seq_lens
            tok = q[cu[0] : cu[0] + n_dec]  # [B_dec, Hq, D]
            tok_idx = None
        else:
            seq_idx = torch.tensor(decode_seqs, device=device)
            tok_idx = torch.tensor([cu[b] for b in decode_seqs], device=device)
            rows = tables[seq_idx, :num_dec_blocks]
            dec_lens = seq_lens[seq_idx]
            tok = q[tok_idx]
        # index_select on the flat block list is ~4x faster on CPU than k_cache[rows].
        # [B_dec * nblk, bs, Hkv, D] -> [B_dec, L, Hkv, D] -> [B_dec, Hkv, L, D]
        flat = rows.reshape(-1)
        k = k_cache.index_select(0, flat).to(q.dtype).view(n_dec, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat).to(q.dtype).view(n_dec, -1, num_kv_heads, head_dim).transpose(1, 2)
        key_pos = torch.arange(k.shape[2], device=device)
        mask = (key_pos[None, :] < dec_lens[:, None])[:, None, None, :]  # [B_dec, 1, 1, L]
        o = F.scaled_dot_product_attention(
            tok.unsqueeze(2),  # [B_dec, Hq, 1, D]
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        ).squeeze(2)  # [B_dec, Hq, D]
        if tok_idx is None:
            out[cu[0] : cu[0] + n_dec] = o
        else:
            out[tok_idx] = o
    return out
