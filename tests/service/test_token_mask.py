"""The batched token-mask step (service/worker/token_mask.py) and a request's grammar state
following its output list (service/worker/grammar_state.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from service.worker.grammar_state import GrammarState
from service.worker.token_mask import (apply_token_masks_, fill_token_masks, mask_words,
                                       unpack_token_masks)


def bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """Reference packing: bit t % 32 of word t // 32, built with Python ints."""
    words = []
    for row in allowed:
        w = [0] * mask_words(vocab)
        for t in row:
            w[t // 32] |= 1 << (t % 32)
        words.append([x - (1 << 32) if x >= 1 << 31 else x for x in w])
    return torch.tensor(words, dtype=torch.int32)


def test_unpack_matches_the_bit_layout():
    vocab = 70  # three words, the last one partial
    allowed = [[0, 2, 31, 32, 63, 69], [], list(range(70))]
    got = unpack_token_masks(bitmask(allowed, vocab), vocab)
    assert got.shape == (3, vocab)
    for row, want in zip(got, allowed):
        assert row.nonzero().flatten().tolist() == want


def test_only_the_constrained_rows_change():
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab)
    before = logits.clone()
    masks = bitmask([[5, 7], [99]], vocab)
    apply_token_masks_(logits, torch.tensor([1, 3]), masks)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for r, keep in ((1, [5, 7]), (3, [99])):
        finite = torch.isfinite(logits[r]).nonzero().flatten().tolist()
        assert finite == keep
        assert torch.equal(logits[r, keep], before[r, keep])
    assert logits[1].argmax().item() in (5, 7) and logits[3].argmax().item() == 99


def test_every_row_masked_in_place_without_indices():
    logits = torch.zeros(2, 40)
    apply_token_masks_(logits, None, bitmask([[1], [39]], 40))
    assert logits.argmax(dim=1).tolist() == [1, 39]
    with pytest.raises(ValueError):
        apply_token_masks_(logits, None, bitmask([[1]], 40))


class FakeConstraint:
    """Writes a fixed allowed set; or fails."""

    def __init__(self, allowed: list[int], why: str | None = None) -> None:
        self.allowed, self.why = allowed, why

    def fill_mask(self, ptr: int, nbytes: int) -> str | None:
        words = (ctypes.c_uint32 * (nbytes // 4)).from_address(ptr)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        return self.why


def test_fill_reports_failures_and_empty_masks():
    masks, failed = fill_token_masks([FakeConstraint([3, 40]), FakeConstraint([]),
                                      FakeConstraint([1], "bad token")], 64)
    assert masks.shape == (3, 2)
    assert unpack_token_masks(masks, 64)[0].nonzero().flatten().tolist() == [3, 40]
    assert failed == {1: "the output grammar admits no next token", 2: "bad token"}


class FakeMatcher:
    """Records what it consumed; refuses a rollback deeper than `max_back`."""

    def __init__(self, max_back: int = 100) -> None:
        self.seen: list[int] = []
        self.max_back = max_back
        self.resets = 0

    def consume_tokens(self, ids):
        self.seen += ids
        return True

    def rollback(self, n):
        if n > self.max_back:
            return False
        del self.seen[len(self.seen) - n:]
        return True

    def reset(self):
        self.seen, self.resets = [], self.resets + 1

    def is_error(self):
        return False

    def get_error(self):
        return ""

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        ctypes.memset(ptr, 0xFF, nbytes)


def test_grammar_state_follows_the_output_list():
    tokens: list[int] = []
    m = FakeMatcher(max_back=1)
    state = GrammarState(m, tokens)
    buf = (ctypes.c_int32 * 2)()
    tokens += [5, 6, 7]
    assert state.fill_mask(ctypes.addressof(buf), 8) is None and m.seen == [5, 6, 7]
    tokens.append(8)
    state.fill_mask(ctypes.addressof(buf), 8)
    assert m.seen == [5, 6, 7, 8]  # only the new token consumed
    tokens.pop()
    state.sync()
    assert m.seen == [5, 6, 7] and m.resets == 0  # rolled back by one
    del tokens[1:]
    state.sync()
    assert m.seen == [5] and m.resets == 1  # too deep to roll back: reset and replayed
