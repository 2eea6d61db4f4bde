"""The linear layer interface of the model, and its dense implementation."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    """`y = x @ W^T (+ b)`: x [T, in] float32 -> y [T, out] float32."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """`F.linear` with the weight in the `[out, in]` layout it reads fastest.

    Args:
        weight: [out, in]; bias: [out] or None. Kept as given (same dtype, device).
    """

    __slots__ = ("weight", "bias", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        check_weight(weight, bias)
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def clone(self) -> DenseLinear:
        """The same layer on distinct memory (benchmarks stream copies from DRAM)."""
        return DenseLinear(self.weight.clone(), self.bias)


def check_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raises ValueError unless weight is [out, in] and bias None or [out]."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [out] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")


class PendingLinear:
    """A layer read as a checkpoint's own blocks, before the linear plan puts a kernel on it
    (``LlamaModel.quantize``): it holds the blocks and the bias, and runs nothing.

    Args:
        blocks: ``service.worker.gguf_weights.RawBlocks`` (``out_features``,
            ``in_features``, ``dequantize()``); bias: [out] float32 or None.
    """

    __slots__ = ("blocks", "bias", "in_features", "out_features")

    def __init__(self, blocks: object, bias: torch.Tensor | None = None) -> None:
        self.blocks, self.bias = blocks, bias
        self.out_features = blocks.out_features  # type: ignore[attr-defined]
        self.in_features = blocks.in_features  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's blocks have no kernel yet: the linear plan "
                           "(LlamaModel.quantize) has not run")
