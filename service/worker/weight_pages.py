"""The C++ linear kernels' packed weights moved onto transparent huge pages (policy).

A one-row decode step streams every packed weight once, 96 MB for SmolLM2's Q4_1 GGUF, in
121 calls of 0.2-1.1 MB (30 MB for the LM head). On 4 KiB pages each call's two threads
cross a page every 4 KiB: a TLB miss, and the hardware prefetcher, which does not follow a
stream across a page boundary, starts over. Copied into one arena advised to 2 MiB pages
(`huge_pages.copies_on_huge_pages`), the same reads cross a page every 2 MiB.
Measured on a 2-core Zen 4 (2026-12-04, C++ harness, 120 one-row q4_1 calls of SmolLM2's
shapes over random weights, alternating 15 rounds): 4 KiB pages 2.30-2.48 ms, the arena
2.03 ms (1.12-1.20x by round's median); in the real step, two engines alternating 10
rounds, one decode 1.16x (median) and 16 decodes 0.99x. On a 2-core Zen 3 (2026-12-02, commit abb5aec) the
same arena gave 1.007x: it is advice that costs a copy at start-up (233 MB in 0.44 s for the
default GGUF; 4 bytes a weight where fp32 C++ paths serve decode, as in the batch-invariant
fp32 mode), not a guarantee.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kernels.packed_parts import PackedParts
from kernels.quant_pack import PackedWeight
from service.worker.huge_pages import on_huge_pages, slots_on_huge_pages
from service.worker.quantization.paths import CppLinear
from service.worker.quantization.plan import DispatchLinear, bucket_index

if TYPE_CHECKING:
    from service.worker.model import LlamaModel


def packed_weights_on_huge_pages(model: LlamaModel, max_rows: int = 31) -> int:
    """Move the packed weights of `model`'s C++ linear paths that serve calls of up to
    `max_rows` rows (the memory-bound decode buckets; the LM head included) into one
    huge-page arena, in place: each CppLinear then reads the copy, and the old tensors are
    freed unless something else holds them. Many-row buckets are compute-bound and keep
    their pages (the fp32 copies some take would add 0.6 GB to the move). Call it before
    anything keeps the weights' addresses (the fused forward does). Returns the bytes moved
    (0 where no such path runs on a C++ kernel). Tensors move one at a time, each freed once
    copied (every path reading it switched to the copy), so memory grows by one tensor at
    most."""
    buckets = range(bucket_index(max_rows) + 1)
    fields = [f.name for f in dataclasses.fields(PackedWeight)
              if f.type in ("torch.Tensor | None", "torch.Tensor")]
    decode: dict[int, CppLinear] = {}  # by id: buckets that share a path share the object
    every: dict[int, CppLinear] = {}
    for lin in model.linears():
        fns = lin.fns if isinstance(lin, DispatchLinear) else [lin]
        for b, fn in enumerate(fns):
            if isinstance(fn, CppLinear):
                every.setdefault(id(fn), fn)
                if not isinstance(lin, DispatchLinear) or b in buckets:
                    decode.setdefault(id(fn), fn)
    # A tensor moves once, however many paths read it (q4_k's and q4_kx16's packed weights
    # share theirs), and every path that reads it, many-row buckets included, then reads the
    # copy: one copy of each weight, never two.
    tensors: dict[int, torch.Tensor] = {}
    for fn in decode.values():
        for _, part in _parts(fn):
            for f in fields:
                t = getattr(part, f)
                if t is not None and not on_huge_pages(t):  # packed there already: stays
                    tensors.setdefault(id(t), t)
    readers: dict[int, list[tuple[CppLinear, int | None, str]]] = {k: [] for k in tensors}
    for fn in every.values():
        for i, part in _parts(fn):
            for f in fields:
                t = getattr(part, f)
                if t is not None and id(t) in readers:
                    readers[id(t)].append((fn, i, f))
    slots = slots_on_huge_pages(list(tensors.values()))
    moved = 0
    # one tensor at a time: copied, then every reader switched to the copy, so the old one
    # is freed (nothing else holds it) and memory grows by one tensor at most
    for key, slot in zip(list(tensors), slots):
        old = tensors.pop(key)
        slot.copy_(old)
        moved += slot.numel() * slot.element_size()
        for fn, i, f in readers.pop(key):
            if i is None:
                fn.packed = dataclasses.replace(fn.packed, **{f: slot})
            else:  # a split weight's part
                parts = list(fn.packed.parts)
                parts[i] = dataclasses.replace(parts[i], **{f: slot})
                fn.packed = PackedParts(tuple(parts))
        del old
    return moved


def _parts(fn: CppLinear) -> list[tuple[int | None, PackedWeight]]:
    """(index in a split weight or None, packed weight) of what `fn` multiplies by."""
    if isinstance(fn.packed, PackedParts):
        return list(enumerate(fn.packed.parts))
    return [(None, fn.packed)]
