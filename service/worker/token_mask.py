"""Token masks of constrained rows applied to a step's logits in one batched call.

Structured output and tool calls (issue 48) restrict which tokens a request may sample
next. Each constrained row gets a bitmask from its grammar state (`fill_token_masks`:
int32 words, bit t % 32 of word t // 32 set where token t is allowed, the layout
llguidance and xgrammar write), and `apply_token_masks_` sets every disallowed logit of
those rows to -inf with one unpack and one masked fill over the constrained rows only.
An unconstrained row is never read or written here: its cost stays the sampler's.

This is a separate step before sampling (`SamplingStep.sample`), after the
forward (fused or not) and before temperature / top-k / top-p / min-p, so the sampler
draws only among the allowed tokens and greedy picks the best allowed one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from service.core.scheduler_output import TokenConstraint

__all__ = ["apply_token_masks_", "fill_token_masks", "mask_words", "unpack_token_masks"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)  # bit i of a byte is token 8 * byte + i


def mask_words(vocab: int) -> int:
    """int32 words of one row's bitmask: ceil(V / 32)."""
    return (vocab + 31) // 32


def fill_token_masks(constraints: Sequence[TokenConstraint], vocab: int
                     ) -> tuple[Tensor, dict[int, str]]:
    """The bitmasks of C constrained rows, [C, ceil(V / 32)] int32 (CPU), and the rows that
    cannot go on: row index -> why (the grammar failed on a token, or admits no token).

    Each constraint consumes its request's new tokens first (`TokenConstraint.fill_mask`).
    Cost: the grammar work of each row (about 5-20 us for a JSON schema at V = 49,152 on
    Zen 4), nothing per unconstrained row.
    """
    words = mask_words(vocab)
    masks = torch.zeros((len(constraints), words), dtype=torch.int32)
    failed: dict[int, str] = {}
    base, row_bytes = masks.data_ptr(), words * 4
    for i, c in enumerate(constraints):
        why = c.fill_mask(base + i * row_bytes, row_bytes)
        if why is not None:
            failed[i] = why
    if constraints:
        empty = (masks == 0).all(dim=1).nonzero().flatten().tolist()
        for i in empty:
            failed.setdefault(i, "the output grammar admits no next token")
    return masks, failed


def unpack_token_masks(masks: Tensor, vocab: int) -> Tensor:
    """[C, W] int32 bitmasks -> [C, V] bool, True where the token is allowed.

    Read as bytes (x86 and every torch CPU target are little-endian: byte k of word w
    holds tokens 32w + 8k .. 32w + 8k + 7). E.g. word 0 = 0b101: tokens 0 and 2.
    """
    assert sys.byteorder == "little", "token bitmasks are read as little-endian words"
    rows = masks.shape[0]
    as_bytes = masks.contiguous().view(torch.uint8)  # [C, 4W]
    bits = as_bytes.unsqueeze(-1).bitwise_right_shift(_SHIFTS.to(masks.device)) & 1  # [C, 4W, 8]
    return bits.view(rows, -1)[:, :vocab].bool()  # [C, V]


def apply_token_masks_(logits: Tensor, rows: Tensor | None, masks: Tensor) -> Tensor:
    """Set the disallowed tokens of the masked rows to -inf, in place; returns `logits`.

    logits: [B, V] float (any float dtype), the step's sampling rows.
    rows: [C] int64 indices into B of the constrained rows, or None when C == B (every
        row is constrained, in order).
    masks: [C, ceil(V / 32)] int32 bitmasks (`fill_token_masks`); moved to the logits'
        device if needed.

    Raises ValueError on a shape mismatch.
    """
    batch, vocab = logits.shape
    count = batch if rows is None else rows.shape[0]
    if masks.shape != (count, mask_words(vocab)):
        raise ValueError(f"masks must be [{count}, {mask_words(vocab)}], got {tuple(masks.shape)}")
    if count == 0:
        return logits
    disallowed = ~unpack_token_masks(masks.to(logits.device), vocab)  # [C, V]
    if rows is None:
        return logits.masked_fill_(disallowed, float("-inf"))
    sub = logits.index_select(0, rows).masked_fill_(disallowed, float("-inf"))  # [C, V]
    return logits.index_copy_(0, rows, sub)
