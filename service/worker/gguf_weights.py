"""A GGUF checkpoint's linear weights in their own block format, read raw (``gguf.GGUFReader``).

transformers dequantizes a GGUF file to fp32 (``service.worker.loader``); serving those
weights re-quantized would change them. Here the blocks themselves are read instead: a
block type our kernels reproduce exactly becomes a packed weight for them
(``kernels.quant_pack``), equal to transformers' dequantized fp32 weight bit for bit.

| GGUF types (of a layer's parts) | served as | bits a weight |
|---|---|---|
| Q4_0 (w = d (q - 8)) | q4_0: q4_1 without mins, the kernel forms -8 d | 4.5 (the file's) |
| Q4_1; Q4_1 with Q4_0 (min = -8 d, exact in fp16) | q4_1 | 5.0 |
| Q8_0; Q5_0 (q - 16) | q8_0 | 8.5 (Q5_0: 5.5 in the file) |
| Q4_K | q4_k: its super-blocks (6-bit scales and mins per 32, fp16 d, dmin per 256) | 4.625 (4.5) |
| Q5_K | q5_k: its 4 + 1-bit values, Q4_K's scales | 5.625 (5.5) |
| Q6_K | q6_k: its 4 + 2-bit values, int8 scale per 16, fp16 d per 256 | 6.5625 (the file's) |
| Q2_K, Q3_K, or a mix of K-quants | i8_k: 8-bit values, K-style scales | 9.1 |
| Q5_1, or a mix of it with Q4_0 .. Q8_0 | i8_k over super-blocks of 32 | 10 |
| parts in different formats of the above (Q4_K_M's qkv: Q4_K q, k and a Q6_K v) | split: each run of parts in its own (``kernels.packed_parts``) | each part's |
| F32, F16, BF16 | dense fp32 | 32 |
| IQ*, TQ*, ... | dense fp32, dequantized (one warning) | 32 |

(``kernels.gguf_pack``: each packed weight unpacks to gguf-py's dequantization bit for bit.)

ggml's block layout (ggml-quants.c, ``block_q4_1`` etc.): byte j of a 4-bit block holds
weight j in its low nibble and weight j + 16 in its high one. A weight is read as
``RawBlocks``: the file's block rows themselves (views of the mapped file, rows in
transformers' order: ``service.worker.gguf_file``), packed on demand. A type no kernel of
ours reproduces is served from its dequantized fp32 weight (gguf-py's, ggml's reference),
named in one log line.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.quant_pack import PackedWeight, pack_q4_1_blocks, pack_q8_0_blocks
from kernels.gguf_pack import gguf_format, pack_gguf, split_runs
from kernels.packed_parts import SPLIT, AnyPacked, PackedParts
from service.worker.gguf_file import GGUFFile
from service.worker.huge_pages import empty_on_huge_pages, release_pages

if TYPE_CHECKING:
    from service.worker.loader import LoadedModel

BLOCK = 32
NATIVE_TYPES = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q8_0": "q8_0"}
"""GGUF block types served in their own format -> our packed format."""
DENSE_TYPES = ("F32", "F16", "BF16")
"""Unquantized types: nothing to reproduce (fp32 holds them exactly)."""
CLASS_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
               "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
"""Our fused linear classes -> the GGUF tensors of a block they are made of, in row order."""


@dataclass(frozen=True)
class BlockWeight:
    """One linear weight as its GGUF blocks, rows in the model's (transformers') order.

    gguf_types: the file's type of each part (e.g. ("Q4_1", "Q4_1", "Q4_1") for a fused qkv).
    fmt: "q4_1" or "q8_0". q: [N, K] uint8 in [0, 15] (q4_1) or int8 (q8_0).
    d: [N, K / 32] float16; m: [N, K / 32] float16 (q4_1) or None.
    """

    gguf_types: tuple[str, ...]
    fmt: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    def pack(self, bias: torch.Tensor | None = None) -> PackedWeight:
        """The packed weight for our kernels (``kernels.quant_pack``)."""
        if self.fmt == "q4_1":
            assert self.m is not None
            return pack_q4_1_blocks(self.q, self.d, self.m, bias, group=BLOCK)
        return pack_q8_0_blocks(self.q, self.d, bias, group=BLOCK)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: d q + m (q8_0: d q), as ggml and gguf-py dequantize (d q is exact
        in fp32, so this is one rounding, the kernel's fma)."""
        n, k = self.q.shape
        w = self.q.view(n, k // BLOCK, BLOCK).float() * self.d.float()[..., None]
        if self.m is not None:
            w += self.m.float()[..., None]
        return w.view(n, k)

    @property
    def file_bytes(self) -> int:
        """Bytes the weight takes in the file."""
        per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
        rows = self.q.shape[0] // len(self.gguf_types)  # for a report only: parts may differ
        return sum(per_block[t] for t in self.gguf_types) * rows * (self.q.shape[1] // BLOCK)


def _decode(name: str, raw: np.ndarray, k: int) -> BlockWeight:
    """Raw Q4_0 / Q4_1 / Q8_0 block rows [N, row bytes] -> their BlockWeight."""
    n = raw.shape[0]
    raw = np.ascontiguousarray(raw).reshape(n, k // BLOCK, -1)          # [N, G, block bytes]
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])  # [N, G]
    if name == "Q8_0":
        q = torch.from_numpy(raw[..., 2:34].copy().view(np.int8)).reshape(n, k)
        return BlockWeight((name,), "q8_0", q, d, None)
    if name == "Q4_1":
        m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0])
        packed = raw[..., 4:20]
    else:  # Q4_0: w = d (q - 8) = d q + (-8 d); -8 d is exact in fp16 (a power of two)
        m = -8 * d
        packed = raw[..., 2:18]
    nib = torch.from_numpy(packed.copy())                               # [N, G, 16]
    q = torch.cat([nib & 15, nib >> 4], dim=-1).reshape(n, k)           # weight j, j + 16
    return BlockWeight((name,), "q4_1", q, d, m)


def _cat(parts: list[BlockWeight]) -> BlockWeight:
    return BlockWeight(tuple(t for p in parts for t in p.gguf_types), parts[0].fmt,
                       torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                       None if parts[0].m is None else torch.cat([p.m for p in parts]))  # type: ignore[misc]


def served_format(gguf_types: Sequence[str]) -> str | None:
    """Our packed format for a weight whose parts have these GGUF types
    (``kernels.gguf_pack.gguf_format``: q4_0, q4_1, q8_0, q4_k, q5_k, q6_k, i8_k; "split"
    where the parts' own formats differ, ``split_runs``), or None: served from its dequantized fp32 weight (a
    type no kernel of ours reproduces; float types, which fp32 holds exactly)."""
    if split_runs(gguf_types) is not None:
        return SPLIT
    fmt = gguf_format(gguf_types)
    return None if fmt == "f32" else fmt


@dataclass(frozen=True, eq=False)
class RawBlocks:
    """One linear weight as the file's own block rows, rows in the model's (transformers')
    order: what is served (``pack``) and the oracle's weight (``dequantize``).

    gguf_types: the file's type of each part (e.g. ("Q4_K", "Q4_K", "Q6_K") for a fused
        qkv whose v is Q6_K). raw: per part, [N_i, row bytes] uint8: views of the
        memory-mapped file (no copy), or a copy where rows were reordered (Q / K).
    in_features: K, the weights a row holds.
    """

    gguf_types: tuple[str, ...]
    raw: tuple[np.ndarray, ...]
    in_features: int

    @property
    def fmt(self) -> str | None:
        """The packed format serving it (``served_format``), None: served dequantized."""
        return served_format(self.gguf_types)

    @property
    def out_features(self) -> int:
        return sum(r.shape[0] for r in self.raw)

    @property
    def file_bytes(self) -> int:
        """Bytes the weight takes in the file."""
        return sum(r.nbytes for r in self.raw)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the file's weight as gguf-py (ggml's reference) dequantizes it."""
        import gguf

        parts = [gguf.quants.dequantize(np.ascontiguousarray(r), gguf.GGMLQuantizationType[t])
                 for t, r in zip(self.gguf_types, self.raw)]
        w = np.concatenate([p.reshape(-1, self.in_features) for p in parts])
        return torch.from_numpy(w.astype(np.float32, copy=False))

    def decoded(self) -> BlockWeight:
        """The weight in NATIVE_TYPES' decoded form (q, d, m). Raises ValueError for
        another type or a mix of formats."""
        if self.fmt not in ("q4_0", "q4_1", "q8_0") or \
                not set(self.gguf_types) <= set(NATIVE_TYPES):
            raise ValueError(f"GGUF types {self.gguf_types} have no packed format of ours")
        return _cat([_decode(t, r, self.in_features) for t, r in zip(self.gguf_types, self.raw)])

    def pack(self, bias: torch.Tensor | None = None) -> AnyPacked:
        """The packed weight for our kernels (``kernels.gguf_pack.pack_gguf``; a split weight
        of such, ``kernels.packed_parts.PackedParts``, where ``fmt`` is "split"), equal to
        ``dequantize()`` bit for bit, written straight into a huge-page arena (the decode
        weights' pages, ``service.worker.weight_pages``; no move afterwards). Raises
        ValueError where ``fmt`` is None."""
        if self.fmt is None:
            raise ValueError(f"GGUF types {self.gguf_types} have no packed format of ours")
        with warnings.catch_warnings():  # read-only file views, only read by pack_gguf
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            parts = [(t, torch.from_numpy(np.ascontiguousarray(r)))
                     for t, r in zip(self.gguf_types, self.raw)]
        runs = split_runs(self.gguf_types)
        if runs is None:
            return pack_gguf(parts, bias, allocate=empty_on_huge_pages)
        packed, start = [], 0
        for _, indices in runs:
            rows = sum(parts[i][1].shape[0] for i in indices)
            packed.append(pack_gguf([parts[i] for i in indices],
                                    None if bias is None else bias[start:start + rows],
                                    allocate=empty_on_huge_pages))
            start += rows
        return PackedParts(tuple(packed))

    def head_rows(self, rows: int | Sequence[int]) -> tuple[RawBlocks, torch.Tensor]:
        """(the first `rows` rows of each part (or rows[i] of part i), as one weight; their
        row indices in this weight [<= rows * parts] int64): a sample that holds every part's
        type, for the kernel choice's correctness check (the whole layer there cost 1.7 GB of
        fp32 at the 8B shape) and its timing of compute-bound buckets. Views, no copy."""
        per_part = [rows] * len(self.raw) if isinstance(rows, int) else list(rows)
        heads, index, start = [], [], 0
        for r, want in zip(self.raw, per_part):
            m = min(want, r.shape[0])
            heads.append(r[:m])
            index.append(torch.arange(start, start + m))
            start += r.shape[0]
        return RawBlocks(self.gguf_types, tuple(heads), self.in_features), torch.cat(index)

    def release(self) -> None:
        """Drop the file's pages behind it from the resident set (``release_pages``)."""
        for r in self.raw:
            release_pages(r)


@dataclass(frozen=True)
class GGUFLinearWeights:
    """A GGUF file's linear layers in their own blocks.

    layers: (layer index or None for the LM head, class) -> RawBlocks, for "qkv", "o",
        "gate_up", "down" of each decoder layer and (None, "lm_head").
    """

    layers: Mapping[tuple[int | None, str], RawBlocks]

    @property
    def native(self) -> dict[tuple[int | None, str], RawBlocks]:
        """The layers our kernels serve in their own format (``RawBlocks.fmt``)."""
        return {k: v for k, v in self.layers.items() if v.fmt is not None}

    @property
    def dequantized(self) -> dict[tuple[int | None, str], tuple[str, ...]]:
        """The other layers (a type we cannot reproduce, or parts of different formats) ->
        their parts' GGUF types: served from their dequantized fp32 weights."""
        return {k: v.gguf_types for k, v in self.layers.items() if v.fmt is None}

    def dequantized_types(self) -> Counter[str]:
        """GGUF type -> number of linear layers it made be served dequantized."""
        return Counter(t for types in self.dequantized.values() for t in set(types)
                       if t not in NATIVE_TYPES and t not in DENSE_TYPES)


def read_linear_weights(path: str, num_layers: int, num_heads: int,
                        num_kv_heads: int, file: GGUFFile | None = None) -> GGUFLinearWeights:
    """Read the linear layers of the Llama-family GGUF file at `path` in their own blocks
    (views of the mapped file: nothing is copied but Q / K rows, which are reordered).

    The LM head is ``output.weight``, or the token embedding (``token_embd``) when the file
    has none (tied, as transformers decides). Raises ValueError when a tensor the model
    needs is missing.
    """
    f = file or GGUFFile(path)
    heads_of = {"attn_q": num_heads, "attn_k": num_kv_heads}
    layers: dict[tuple[int | None, str], RawBlocks] = {}
    for i in range(num_layers):
        for cls, names in CLASS_PARTS.items():
            parts = [f.raw(f"blk.{i}.{n}.weight", heads_of.get(n)) for n in names]
            layers[(i, cls)] = _linear(parts, f"layer {i} {cls}")
    layers[(None, "lm_head")] = _linear([f.raw(f.lm_head_name())], "the LM head")
    return GGUFLinearWeights(layers)


def _linear(parts: list[tuple[str, np.ndarray, int]], what: str) -> RawBlocks:
    ks = {k for _, _, k in parts}
    if len(ks) != 1:
        raise ValueError(f"{what}: parts differ in input features {sorted(ks)}")
    return RawBlocks(tuple(t for t, _, _ in parts), tuple(r for _, r, _ in parts), ks.pop())


def linear_weights_of(loaded: LoadedModel, *, keep: bool) -> GGUFLinearWeights | None:
    """The GGUF linear weights of `loaded` (None for an HF folder), read once per LoadedModel
    when `keep` (kept on it for the next runner), else read and not kept (their unpacked
    values are not held once the runner has packed them)."""
    if loaded.gguf_path is None:
        return None
    if isinstance(loaded.gguf_linear, GGUFLinearWeights):
        return loaded.gguf_linear
    cfg = loaded.hf_config
    got = read_linear_weights(loaded.gguf_path, cfg.num_hidden_layers,
                              cfg.num_attention_heads, cfg.num_key_value_heads)
    if keep:
        loaded.gguf_linear = got
    return got
