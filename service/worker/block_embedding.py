"""The token embedding looked up from a GGUF tensor's own blocks: only the rows a step needs
are dequantized (gguf-py's ``dequantize``, ggml's reference: the oracle's values).

A [V, H] fp32 table costs 4 bytes a weight (805 MB for a 49,152 x 4,096 one); its blocks cost
the file's bytes (Q4_K: 0.56 bytes a weight, 113 MB).
"""

from __future__ import annotations

import numpy as np
import torch


class BlockEmbedding:
    """`embed(ids)`: rows of a GGUF token embedding as float32.

    Args:
        gguf_type: the tensor's GGUF type name ("Q4_K", "Q8_0", "F16", ...).
        rows: [V, row bytes] uint8, one row per token (copied here, so the file's pages
            can be released).
        hidden: H, the values a row holds.

    Raises ValueError (at lookup) for an id outside [0, V).
    """

    def __init__(self, gguf_type: str, rows: np.ndarray, hidden: int) -> None:
        import gguf

        self.qtype = gguf.GGMLQuantizationType[gguf_type]
        self.gguf_type = gguf_type
        self.rows = np.array(rows, dtype=np.uint8, copy=True, order="C")
        self.shape = (self.rows.shape[0], hidden)
        self.dtype = torch.float32

    @property
    def num_embeddings(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, H] float32, contiguous."""
        import gguf

        idx = ids.detach().cpu().numpy()
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.shape[0]):
            raise ValueError(f"token id out of the vocabulary [0, {self.shape[0]})")
        w = gguf.quants.dequantize(self.rows[idx], self.qtype)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)
                                .reshape(len(idx), self.shape[1])).to(ids.device)
