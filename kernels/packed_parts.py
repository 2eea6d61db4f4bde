"""A fused linear weight served as its parts, each in its own packed format.

A GGUF file may give the parts of one of our fused layers different block types: Q4_K_M
quantizes ``attn_v`` of a third of the layers (and the first and last eighth) as Q6_K and
``attn_q`` / ``attn_k`` as Q4_K (llama.cpp's ``use_more_bits``). One packed format that
reproduces both is ``i8_k`` at 9.125 bits a weight, twice Q4_K's 4.5: at Llama-3.1-8B's
shape that is 0.2 GB more read by every decode step (4,654 against 4,444 MB split;
``docs/perf/HISTORY.md``, 2026-12-06, late night). ``PackedParts`` keeps each run of rows in the format of its own blocks
(``kernels.gguf_pack.split_runs``): the kernel (``kernels.quant_linear_cpu.quant_linear``)
and the fused forward (``kernels.decode_forward_cpu``) call it once a part, each part
writing its columns of the one output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.quant_pack import PackedWeight

SPLIT = "split"
"""``PackedParts.fmt`` of parts with fp32 activations (``splitx16``: int16 ones)."""


@dataclass(frozen=True, eq=False)
class PackedParts:
    """Output rows [0, N_0) from parts[0], [N_0, N_0 + N_1) from parts[1], and so on.

    parts: at least two packed weights (``kernels.quant_pack.PackedWeight``) of one input
        width K; each carries its own rows' bias (or None).

    Raises ValueError for fewer than two parts or parts of different K.
    """

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a split weight needs at least two parts, got {len(self.parts)}")
        ks = {p.in_features for p in self.parts}
        if len(ks) != 1:
            raise ValueError(f"a split weight's parts differ in input features {sorted(ks)}")

    @property
    def fmt(self) -> str:
        """"split", or "splitx16" where every part multiplies int16 activations."""
        return SPLIT + ("x16" if all(p.fmt.endswith("x16") for p in self.parts) else "")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """[N] float32 (the parts' biases without their padding), or None where no part has
        one. A part without a bias contributes zeros."""
        if all(p.bias is None for p in self.parts):
            return None
        return torch.cat([p.bias[:p.out_features] if p.bias is not None
                          else torch.zeros(p.out_features) for p in self.parts])

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read for the weight (every part's data, scales and bias)."""
        return sum(p.nbytes for p in self.parts)

    def map(self, fn: Callable[[PackedWeight], PackedWeight]) -> PackedParts:
        """The same split with `fn` applied to each part (e.g. int16 activations)."""
        return PackedParts(tuple(fn(p) for p in self.parts))


AnyPacked = PackedWeight | PackedParts
"""What a C++ linear path multiplies by."""


def per_part(fn: Callable[[PackedWeight], PackedWeight], packed: AnyPacked) -> AnyPacked:
    """`fn(packed)`, or for a split weight the split of `fn` of each part."""
    return packed.map(fn) if isinstance(packed, PackedParts) else fn(packed)


def unpack_any(packed: AnyPacked) -> torch.Tensor:
    """[N, K] float32: ``kernels.quant_pack.unpack`` of `packed`, or of each part of a split
    weight, rows in order (the torch reference)."""
    from kernels.quant_pack import unpack

    if isinstance(packed, PackedParts):
        return torch.cat([unpack(p) for p in packed.parts])
    return unpack(packed)
