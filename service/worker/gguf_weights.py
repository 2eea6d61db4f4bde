"""A GGUF checkpoint's linear weights in their own block format, read raw (``gguf.GGUFReader``).

transformers dequantizes a GGUF file to fp32 (``service.worker.loader``); serving those
weights re-quantized would change them. Here the blocks themselves are read instead: a
block type our kernels reproduce exactly becomes a packed weight for them
(``kernels.quant_pack``), equal to transformers' dequantized fp32 weight bit for bit.

| GGUF type | block (32 weights) | served as | bits a weight |
|---|---|---|---|
| Q4_1 | fp16 d, fp16 m, 16 bytes of nibbles: w = d q + m | q4_1 | 5.0 |
| Q4_0 | fp16 d, 16 bytes of nibbles: w = d (q - 8) | q4_1 with m = -8 d (exact in fp16) | 5.0 (4.5 in the file) |
| Q8_0 | fp16 d, 32 int8: w = d q | q8_0 | 8.5 |

ggml's block layout (ggml-quants.c, ``block_q4_1`` etc.): byte j of a 4-bit block holds
weight j in its low nibble and weight j + 16 in its high one. Every other type (K-quants,
IQ, ...) is served from transformers' dequantized fp32 weights, named in one log line.

llama.cpp's converter permutes the rows of Q and K of Llama-architecture models (rotary
pairs interleaved); transformers undoes it on load (``LlamaTensorProcessor``), and so do
we, on whole rows, which keeps the blocks (they run along the input dimension).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.quant_pack import PackedWeight, pack_q4_1_blocks, pack_q8_0_blocks

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


def _blocks(tensor) -> BlockWeight:
    """A Q4_0 / Q4_1 / Q8_0 GGUFReader tensor -> its BlockWeight (rows as in the file)."""
    name = tensor.tensor_type.name
    k, n = int(tensor.shape[0]), int(tensor.shape[1])  # ggml: ne0 = input features
    raw = np.ascontiguousarray(tensor.data).reshape(n, k // BLOCK, -1)   # [N, G, block bytes]
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


def _unpermute(w: BlockWeight, heads: int) -> BlockWeight:
    """Undo llama.cpp's Q / K row permutation, as transformers' ``_reverse_permute_weights``:
    the file's rows viewed [heads, dim, 2] are reordered to [heads, 2, dim] (dim = rows per
    head / 2). E.g. a head of 4 rows, file order 0 1 2 3 -> 0 2 1 3."""
    n = w.q.shape[0]
    dim = n // heads // 2
    order = torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(-1)
    return BlockWeight(w.gguf_types, w.fmt, w.q[order], w.d[order],
                       None if w.m is None else w.m[order])


def _cat(parts: list[BlockWeight]) -> BlockWeight:
    return BlockWeight(tuple(t for p in parts for t in p.gguf_types), parts[0].fmt,
                       torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                       None if parts[0].m is None else torch.cat([p.m for p in parts]))  # type: ignore[misc]


@dataclass(frozen=True)
class GGUFLinearWeights:
    """A GGUF file's linear layers in their own formats.

    native: (layer index, class) -> BlockWeight, for "qkv", "o", "gate_up", "down" of each
        decoder layer and (None, "lm_head"); only where every part is of a NATIVE_TYPES type
        of one format.
    dequantized: (layer index or None, class) -> the GGUF types of the parts, for the
        layers served from transformers' fp32 weights instead (a type we cannot reproduce,
        or parts of different formats).
    """

    native: Mapping[tuple[int | None, str], BlockWeight]
    dequantized: Mapping[tuple[int | None, str], tuple[str, ...]]

    def dequantized_types(self) -> Counter[str]:
        """GGUF type -> number of linear layers it made be served dequantized."""
        return Counter(t for types in self.dequantized.values() for t in set(types)
                       if t not in NATIVE_TYPES)


def read_linear_weights(path: str, num_layers: int, num_heads: int,
                        num_kv_heads: int) -> GGUFLinearWeights:
    """Read the linear layers of the Llama-family GGUF file at `path` in their own formats.

    The LM head is ``output.weight``, or the token embedding (``token_embd``) when the file
    has none (tied, as transformers decides). Raises ValueError when a tensor the model
    needs is missing.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else "llama"
    permute = arch == "llama"  # transformers' LlamaTensorProcessor

    def part(name: str, heads: int | None = None) -> BlockWeight | str:
        if name not in tensors:
            raise ValueError(f"{path}: no tensor {name}")
        t = tensors[name]
        if t.tensor_type.name not in NATIVE_TYPES:
            return t.tensor_type.name
        w = _blocks(t)
        return _unpermute(w, heads) if permute and heads else w

    native: dict[tuple[int | None, str], BlockWeight] = {}
    dequantized: dict[tuple[int | None, str], tuple[str, ...]] = {}

    def add(key: tuple[int | None, str], parts: list[BlockWeight | str]) -> None:
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if len(blocks) == len(parts) and len({p.fmt for p in blocks}) == 1:
            native[key] = _cat(blocks) if len(blocks) > 1 else blocks[0]
        else:
            dequantized[key] = tuple(p if isinstance(p, str) else p.gguf_types[0] for p in parts)

    heads_of = {"attn_q": num_heads, "attn_k": num_kv_heads}
    for i in range(num_layers):
        for cls, names in CLASS_PARTS.items():
            add((i, cls), [part(f"blk.{i}.{n}.weight", heads_of.get(n)) for n in names])
    add((None, "lm_head"), [part("output.weight" if "output.weight" in tensors
                                 else "token_embd.weight")])
    return GGUFLinearWeights(native, dequantized)


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
