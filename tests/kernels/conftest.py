"""Kernel tests run natively on CUDA when there is a GPU, else in the Triton
interpreter on CPU. TRITON_INTERPRET must be set before any kernel is first
decorated; ``kernels`` decorates lazily, and pytest imports this file before
the test modules, so setting it here is early enough either way.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances of the issue: fp32 within 1e-4, half types within 2e-2.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def tolerance() -> dict[torch.dtype, float]:
    """Allowed atol/rtol per dtype against the reference."""
    return TOLERANCE


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernels run: CUDA natively, else CPU under the interpreter."""
    return DEVICE


@dataclass
class PagedBatch:
    """A flattened step over a paged cache; shapes as in ``paged_attention``."""

    q: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled ids, -1 padding
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    scale: float


def build_paged_batch(
    specs: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> PagedBatch:
    """specs: (context length incl. this step, query tokens) per sequence.

    Every sequence gets blocks from one random permutation of the pool (so
    tables are non-trivial), tables are padded with -1 and one spare column,
    and the pool has spare blocks filled with large values that must never
    be read.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(needed) + 3
    max_blocks = max(needed, default=0) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    used: list[int] = []
    for b, n in enumerate(needed):
        ids = perm[len(used) : len(used) + n]
        used.extend(ids)
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
    kv = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    unused = [i for i in range(num_blocks) if i not in set(used)]
    kv[:, unused] = 50.0  # poison: finite (like stale K/V), but reading it shifts the result
    # Rows past a sequence's context inside its last block are poisoned too.
    for b, (ctx, _) in enumerate(specs):
        if ctx % block_size:
            kv[:, tables[b, needed[b] - 1], ctx % block_size :] = 50.0
    q_lens = [n for _, n in specs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn((int(cu[-1]), num_kv_heads * group, head_dim), generator=gen)
    return PagedBatch(
        q=q.to(device, dtype),
        kv=kv.to(device, dtype),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        scale=head_dim**-0.5,
    )


def naive_paged_attention(batch: PagedBatch) -> torch.Tensor:
    """Per-token, per-head loop in float64: the definition of the contract."""
    q, k_cache, v_cache = batch.q.cpu().double(), batch.kv[0].cpu().double(), batch.kv[1].cpu().double()
    tables, lens, cu = batch.block_tables.cpu(), batch.seq_lens.tolist(), batch.cu_seqlens_q.tolist()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for b, ctx in enumerate(lens):
        n = cu[b + 1] - cu[b]
        for j in range(n):
            pos = ctx - n + j
            rows = [(int(tables[b, p // block_size]), p % block_size) for p in range(pos + 1)]
            for h in range(q.shape[1]):
                keys = torch.stack([k_cache[blk, off, h // group] for blk, off in rows])
                values = torch.stack([v_cache[blk, off, h // group] for blk, off in rows])
                weights = torch.softmax(keys @ q[cu[b] + j, h] * batch.scale, dim=0)
                out[cu[b] + j, h] = weights @ values
    return out


@pytest.fixture
def make_paged_batch() -> Callable[..., PagedBatch]:
    return build_paged_batch


@pytest.fixture
def naive_attention() -> Callable[[PagedBatch], torch.Tensor]:
    return naive_paged_attention
