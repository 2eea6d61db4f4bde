"""A Llama-family GGUF file's tensors by name, memory-mapped (``gguf_index.GGUFIndex``, or
``gguf.GGUFReader`` for a file it does not read), read in the model's (transformers') row
order.

llama.cpp's converter permutes the rows of Q and K (weights and biases) of
Llama-architecture models, rotary pairs interleaved; transformers undoes it on load
(``LlamaTensorProcessor._reverse_permute_weights``), and so does ``GGUFFile.raw``, on whole
rows, which keeps the blocks (they run along the input dimension).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from service.worker.gguf_index import GGUFIndex


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q / K row permutation: the file's rows viewed [heads, dim, 2] are
    reordered to [heads, 2, dim] (dim = rows per head / 2). E.g. a head of 4 rows, file
    order 0 1 2 3 -> 0 2 1 3. rows: [N, ...]; returns a copy."""
    n = rows.shape[0]
    dim = n // heads // 2
    order = np.arange(n).reshape(heads, dim, 2).transpose(0, 2, 1).reshape(-1)
    return rows[order]


class GGUFFile:
    """The tensors of the GGUF file at `path`; only metadata is read here, tensor data when
    used (views of the mapped file).

    Raises ValueError for a file the gguf package cannot parse."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:  # the header alone (gguf_index: tens of ms where gguf's reader takes seconds)
            index = GGUFIndex(path)
            self.tensors: dict[str, Any] = dict(index.tensors)
            arch = index.fields.get("general.architecture")
        except ValueError:
            import gguf

            try:
                reader = gguf.GGUFReader(path)
            except Exception as e:  # the gguf package raises ValueError, struct.error, ...
                raise ValueError(f"{path}: not a GGUF file the gguf package can read: {e}"
                                 ) from e
            self.tensors = {t.name: t for t in reader.tensors}
            field = reader.fields.get("general.architecture")
            arch = bytes(field.parts[-1]).decode() if field is not None else None
        self.arch = arch if isinstance(arch, str) else "llama"
        self.permute = self.arch == "llama"  # transformers' LlamaTensorProcessor

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str, heads: int | None = None) -> tuple[str, np.ndarray, int]:
        """(GGUF type name, rows [N, row bytes] uint8, K: values a row holds) of tensor
        `name` (a vector is one row), Q / K rows un-permuted where `heads` is given on a
        llama-architecture file. Raises ValueError if the file has no such tensor."""
        if name not in self.tensors:
            raise ValueError(f"{self.path}: no tensor {name}")
        t = self.tensors[name]
        k = int(t.shape[0])
        n = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        rows = t.data.view(np.uint8).reshape(n, -1)
        if self.permute and heads:
            if n == 1:  # a bias: permute its values, one per row
                return t.tensor_type.name, unpermute_rows(rows.reshape(k, -1), heads
                                                         ).reshape(1, -1), k
            rows = unpermute_rows(rows, heads)
        return t.tensor_type.name, rows, k

    def vector(self, name: str, heads: int | None = None) -> torch.Tensor:
        """A 1-D tensor (a norm weight, a bias) as float32 [K]. Raises ValueError if missing."""
        import gguf

        kind, rows, k = self.raw(name, heads)
        v = gguf.quants.dequantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType[kind])
        return torch.from_numpy(np.asarray(v, dtype=np.float32).reshape(-1).copy())

    def lm_head_name(self) -> str:
        """``output.weight``, or the token embedding where the file has none (tied, as
        transformers decides)."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
