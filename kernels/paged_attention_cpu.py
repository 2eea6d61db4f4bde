"""Paged attention on the CPU: planned once per step, decodes gathered in cache-sized groups.

Same contract as ``paged_attention_ref`` (causal attention of a flattened batch
of prefill chunks and decodes over a paged KV cache, GQA without expansion),
split in two so that the work that depends only on the batch layout is done
once per step instead of once per layer:

- ``plan_cpu_attention`` (once per step, from host-side lengths): which rows
  decode, in which groups, with which gather indices and key-padding masks;
  each prefill chunk's blocks and causal mask.
- ``cpu_paged_attention`` (once per layer): gathers and ``scaled_dot_product_attention``,
  or, with ``decode_kernel="cpp"``, the decodes through the C++ kernel of
  ``kernels.decode_attention_cpu`` and the prefill chunks through that of
  ``kernels.prefill_attention_cpu`` (neither gathers: both read the paged cache).

Why groups: gathering every decode's K/V at once (``paged_attention_ref``)
writes the whole gathered context (64 sequences x 300 tokens: 30 MB per layer)
to memory and reads it back, which on a 2-core CPU costs several times the
attention itself. A group's gathered K/V (``group_bytes``, a few MiB) stays
in the L3 cache between the gather and the attention. Each group is padded
only to its own longest context.

GQA: the query heads of one KV head are folded into the query-length axis,
``q [n, Hkv, G, D]`` against ``k [n, Hkv, L, D]``, so K/V are never expanded
(query head h uses KV head h // G, as Hugging Face's ``repeat_kv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_attention_cpu import decode_attention_cpu
from kernels.prefill_attention_cpu import BF16_DOT_MIN_CONTEXT, prefill_attention_cpu
from kernels.prefill_attention_cpu import supports as prefill_supports

DEFAULT_GROUP_BYTES = 4 << 20
"""Gathered K+V bytes of one decode group. On the 2-core reference machine (2 x 1 MiB L2,
32 MiB L3) 4 MiB was fastest of 0.25 to 16 MiB at 16 and 64 sequences (64 x 300 tokens:
104 ms a step vs 132 at 1 MiB and 286 with every decode in one gather)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of consecutive sequences attended together.

    rows: the rows of q (one per sequence), a slice when they are consecutive.
    blocks: [n * nblk] int64 block ids to gather, row-major ([n, nblk] flattened).
    num_blocks: nblk, blocks per sequence (the group's longest context, rounded up).
    mask: [n, 1, 1, nblk * block_size] bool key-padding mask, None when every
        sequence of the group fills its nblk blocks exactly.
    """

    rows: slice | torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class KernelDecodes:
    """Every decode of the step, for the C++ kernel (``decode_attention_cpu``).

    rows: [n] int64 rows of q. block_tables: [n, max_blocks] int64. seq_lens: [n] int64.
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk of n > 1 query tokens.

    rows: slice of q. blocks: [ceil(ctx_len / block_size)] int64 block ids.
    ctx_len: context length including the chunk. mask: [1, 1, n, ctx_len] bool causal mask
    offset by the earlier context, None when the chunk starts at position 0 (plain causal).
    """

    rows: slice
    blocks: torch.Tensor
    ctx_len: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class CpuAttentionPlan:
    """Everything ``cpu_paged_attention`` needs besides q and the cache, for one step.

    num_tokens: T, rows of q. decode_groups / kernel_decodes / prefills: see their classes;
        decodes are in decode_groups (SDPA) or in kernel_decodes (the C++ kernel), never both.
    all_decode_in_order: every sequence decodes and the rows are 0..T-1 in one
        group (the output is the group's result, no copy).
    prefill_kernel: prefill chunks go through the C++ kernel of
        ``kernels.prefill_attention_cpu`` where it supports the layout (else SDPA).
    prefill_bf16_dot: that kernel multiplies in bf16 (its ``bf16_dot``) for chunks whose
        context reaches ``BF16_DOT_MIN_CONTEXT`` tokens (shorter ones keep fp32 products).
    """

    num_tokens: int
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    all_decode_in_order: bool
    kernel_decodes: KernelDecodes | None = None
    prefill_kernel: bool = False
    prefill_bf16_dot: bool = False

    @property
    def kernel_rows_only(self) -> bool:
        """Every row of the step is in kernel_decodes, in order (rows 0..T-1): a step the
        fused forward (``kernels.decode_forward_cpu``) can run whole."""
        kd = self.kernel_decodes
        return kd is not None and not self.prefills and kd.rows.shape[0] == self.num_tokens


def plan_cpu_attention(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: torch.Tensor,
    block_size: int,
    kv_bytes_per_token: int,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    decode_kernel: str = "sdpa",
    all_rows: bool = False,
    prefill_bf16_dot: bool = False,
) -> CpuAttentionPlan:
    """Plan one step's attention (host-side work, once per step for all layers).

    Args:
        query_lens: [B] query tokens of each sequence this step (0 allowed: no rows).
        seq_lens: [B] context length of each sequence, this step's tokens included.
        block_tables: [B, max_blocks] int32 or int64; row b holds the
            ceil(seq_lens[b] / block_size) blocks of sequence b first. Later
            entries may be gathered for a decode group padded to a longer
            context (then masked out): they must be valid block ids or negative
            (read as block 0), e.g. zero padding.
        block_size: tokens per cache block.
        kv_bytes_per_token: bytes of one token's K plus V in one layer (2 Hkv D itemsize).
        group_bytes: gathered K+V bytes per decode group (at least one sequence a group).
        decode_kernel: "sdpa" (decodes gathered in groups, prefill chunks gathered, SDPA)
            or "cpp" (all decodes in one ``KernelDecodes`` for
            ``kernels.decode_attention_cpu``, prefill chunks through
            ``kernels.prefill_attention_cpu``: our C++ attention kernels).
        all_rows: with "cpp", prefill rows too go through the C++ kernel, each as a decode
            over its own causal prefix (no SDPA): a row's output then depends only on its
            query, its context's K/V and its position, never on how the prompt was chunked
            or what else is in the step (batch-invariant mode).
        prefill_bf16_dot: with "cpp", the prefill chunks' kernel multiplies in bf16 where a
            chunk's context reaches ``BF16_DOT_MIN_CONTEXT`` (``prefill_attention_cpu``'s
            bf16_dot: only where ``bf16_dot_available()``).

    Returns:
        The plan; its tensors live on block_tables' device.

    Raises:
        ValueError: lengths of different sizes, a negative length, a chunk longer
            than its context, or a table with fewer columns than a context needs.
    """
    num_seqs = len(query_lens)
    if len(seq_lens) != num_seqs or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_lens ({num_seqs}), seq_lens ({len(seq_lens)}) and block_tables rows "
            f"(shape {tuple(block_tables.shape)}) must describe the same sequences"
        )
    if decode_kernel not in ("sdpa", "cpp"):
        raise ValueError(f"decode_kernel must be 'sdpa' or 'cpp', got {decode_kernel!r}")
    if (all_rows or prefill_bf16_dot) and decode_kernel != "cpp":
        raise ValueError("all_rows and prefill_bf16_dot need decode_kernel 'cpp'")
    if block_size < 1 or kv_bytes_per_token < 1 or group_bytes < 1:
        raise ValueError(
            f"block_size ({block_size}), kv_bytes_per_token ({kv_bytes_per_token}) and "
            f"group_bytes ({group_bytes}) must be >= 1"
        )
    device = block_tables.device
    tables = block_tables.to(torch.int64).clamp(min=0)  # padding may hold anything negative
    decodes: list[tuple[int, int, int]] = []  # (row, sequence, context length)
    prefills: list[PrefillChunk] = []
    row = 0
    for b in range(num_seqs):
        n, ctx = query_lens[b], seq_lens[b]
        if n < 0 or n > ctx:
            raise ValueError(f"sequence {b}: {n} query tokens but context length {ctx}")
        num_blocks = -(-ctx // block_size)
        if num_blocks > tables.shape[1]:
            raise ValueError(
                f"sequence {b}: context {ctx} needs {num_blocks} blocks, block_tables has "
                f"{tables.shape[1]} columns"
            )
        if n == 1:
            decodes.append((row, b, ctx))
        elif n > 1 and all_rows:
            # E.g. ctx 5, n 2: rows attend as decodes at contexts 4 and 5
            decodes.extend((row + i, b, ctx - n + 1 + i) for i in range(n))
        elif n > 1:
            start = ctx - n
            mask = None
            if start > 0:
                # E.g. ctx 5, n 2: query 0 (position 3) sees keys 0..3, query 1 sees 0..4.
                key_pos = torch.arange(ctx, device=device)
                query_pos = torch.arange(start, ctx, device=device)
                mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # [1, 1, n, ctx]
            prefills.append(PrefillChunk(slice(row, row + n), tables[b, :num_blocks], ctx, mask))
        row += n
    if decode_kernel == "cpp":
        kernel = None
        if decodes:
            seqs = [b for _, b, _ in decodes]
            kernel = KernelDecodes(
                rows=torch.tensor([r for r, _, _ in decodes], dtype=torch.int64, device=device),
                block_tables=(tables if seqs == list(range(num_seqs)) else tables[
                    torch.tensor(seqs, device=device)]).contiguous(),
                seq_lens=torch.tensor([c for _, _, c in decodes], dtype=torch.int64,
                                      device=device))
        return CpuAttentionPlan(row, (), tuple(prefills), False, kernel, prefill_kernel=True,
                                prefill_bf16_dot=prefill_bf16_dot)
    groups = _plan_decode_groups(decodes, tables, block_size, kv_bytes_per_token, group_bytes)
    in_order = (len(groups) == 1 and not prefills and len(decodes) == num_seqs
                and isinstance(groups[0].rows, slice) and groups[0].rows.start == 0)
    return CpuAttentionPlan(row, tuple(groups), tuple(prefills), in_order)


def _plan_decode_groups(decodes: list[tuple[int, int, int]], tables: torch.Tensor,
                        block_size: int, kv_bytes_per_token: int,
                        group_bytes: int) -> list[DecodeGroup]:
    """Split the decodes, in order, into groups of at most group_bytes gathered K+V."""
    groups: list[DecodeGroup] = []
    start = 0
    while start < len(decodes):
        # Grow the group while its padded size (members x longest context) fits.
        end, longest = start + 1, decodes[start][2]
        while end < len(decodes):
            longest_next = max(longest, decodes[end][2])
            if (end + 1 - start) * longest_next * kv_bytes_per_token > group_bytes:
                break
            end, longest = end + 1, longest_next
        members = decodes[start:end]
        n = len(members)
        nblk = -(-longest // block_size)
        seqs = [b for _, b, _ in members]
        rows_list = [r for r, _, _ in members]
        first = rows_list[0]
        consecutive = rows_list == list(range(first, first + n))
        if seqs == list(range(seqs[0], seqs[0] + n)):
            table = tables[seqs[0]:seqs[0] + n, :nblk]  # [n, nblk]
        else:
            table = tables[torch.tensor(seqs, device=tables.device), :nblk]
        lens = [ctx for _, _, ctx in members]
        mask = None
        if any(ctx != nblk * block_size for ctx in lens):
            # E.g. block_size 4, contexts [5, 8] -> nblk 2: row 0 sees keys 0..4, row 1 keys 0..7.
            key_pos = torch.arange(nblk * block_size, device=tables.device)
            ctx_t = torch.tensor(lens, device=tables.device)
            mask = (key_pos[None, :] < ctx_t[:, None])[:, None, None, :]  # [n, 1, 1, L]
        rows: slice | torch.Tensor = (slice(first, first + n) if consecutive
                                      else torch.tensor(rows_list, device=tables.device))
        groups.append(DecodeGroup(rows, table.reshape(-1).contiguous(), nblk, mask))
        start = end
    return groups


def cpu_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention of one layer, as ``paged_attention_ref``, following ``plan``.

    Args:
        q: [T, Hq, D]; unit stride in D and Hq * D contiguous per row (a view of
            a fused projection is fine).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, one dtype: q's,
            or a 16-bit one read as q's dtype (``--kv-cache-dtype``); this step's K/V
            already stored. Padding slots inside a gathered block
            are masked, so they must be finite (a zero-initialised cache is).
        plan: from ``plan_cpu_attention`` for this step.
        scale: softmax scale, usually D ** -0.5.

    Returns:
        [T, Hq, D] in q's dtype.

    Raises:
        ValueError: q rows differ from the plan's, or the head counts are not a
            multiple of each other, or the cache is not contiguous (and, for a plan
            with kernel_decodes, what ``decode_attention_cpu`` rejects).
        KernelBuildError: a plan with kernel_decodes or prefill_kernel, and that C++ kernel
            does not build.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens != plan.num_tokens:
        raise ValueError(f"q has {num_tokens} rows, the plan {plan.num_tokens}")
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
            "do not fit (Hq a multiple of Hkv, same D, same cache shapes)"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    group = num_q_heads // num_kv_heads
    slot_elems = block_size * num_kv_heads * head_dim
    k_rows = k_cache.view(k_cache.shape[0], slot_elems)  # [num_blocks, bs * Hkv * D]
    v_rows = v_cache.view(v_cache.shape[0], slot_elems)
    if plan.all_decode_in_order:
        return _decode_group(q, k_rows, v_rows, plan.decode_groups[0], block_size,
                             num_kv_heads, group, scale)
    out = q.new_empty(q.shape)
    if plan.kernel_decodes is not None:
        kd = plan.kernel_decodes
        decode_attention_cpu(q, k_cache, v_cache, kd.block_tables, kd.seq_lens, kd.rows, out,
                             scale)
    for g in plan.decode_groups:
        out[g.rows] = _decode_group(q[g.rows], k_rows, v_rows, g, block_size, num_kv_heads,
                                    group, scale)
    use_kernel = plan.prefill_kernel and prefill_supports(q.dtype, num_q_heads, num_kv_heads,
                                                          head_dim, block_size, k_cache.dtype)
    for p in plan.prefills:
        if use_kernel:
            prefill_attention_cpu(q[p.rows], k_cache, v_cache, p.blocks, p.ctx_len, out[p.rows],
                                  scale, bf16_dot=plan.prefill_bf16_dot
                                  and p.ctx_len >= BF16_DOT_MIN_CONTEXT)
            continue
        k = k_rows.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:p.ctx_len]
        v = v_rows.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:p.ctx_len]
        k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache under fp32 activations
        o = F.scaled_dot_product_attention(
            q[p.rows].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            k.transpose(0, 1).unsqueeze(0),          # [1, Hkv, L, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
            enable_gqa=group > 1,
        )  # [1, Hq, n, D]
        out[p.rows] = o[0].transpose(0, 1)
    return out


def _decode_group(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, g: DecodeGroup,
                  block_size: int, num_kv_heads: int, group: int, scale: float) -> torch.Tensor:
    """[n, Hq, D] attention of n decode rows: gather their blocks, one SDPA call."""
    n, _, head_dim = q.shape
    length = g.num_blocks * block_size
    # [n * nblk, bs * Hkv * D] -> [n, L, Hkv, D] -> [n, Hkv, L, D] (a view)
    k = k_rows.index_select(0, g.blocks).to(q.dtype).view(
        n, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v_rows.index_select(0, g.blocks).to(q.dtype).view(
        n, length, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.reshape(n, num_kv_heads, group, head_dim), k, v, attn_mask=g.mask, scale=scale,
    )  # [n, Hkv, G, D]
    return o.reshape(n, num_kv_heads * group, head_dim)
