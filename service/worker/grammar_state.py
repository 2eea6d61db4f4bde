"""One constrained request's grammar state, kept in step with its output tokens.

A `GrammarState` wraps an llguidance `LLMatcher` (a copy of the compiled grammar's,
`service.engine.constraints.compiler`) and the request's own `output_token_ids` list.
The runner asks it for the next-token bitmask each step the request samples
(`fill_mask`); before writing it the state catches up with the list: the tokens accepted
since the last call are consumed, and a list that got shorter (nothing in the engine does
that today; a recompute keeps the output) is met by rolling the matcher back, or by
resetting it and replaying the whole output when the rollback is refused. So a
preemption by recompute or swap, a failed step retried, or any later change to the list
leaves the state right, with no call from the scheduler.

Used from the step loop's worker thread only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GrammarState"]


class GrammarState:
    """The grammar state of one request (a `service.core.scheduler_output.TokenConstraint`).

    Args:
        matcher: an llguidance LLMatcher at the grammar's start, this request's own.
        tokens: the request's output token list (`Request.output_token_ids`), read only.
    """

    __slots__ = ("matcher", "tokens", "consumed")

    def __init__(self, matcher: Any, tokens: list[int]) -> None:
        self.matcher = matcher
        self.tokens = tokens
        self.consumed = 0  # how many of `tokens` the matcher has consumed

    def sync(self) -> str | None:
        """Consume the tokens accepted since the last call (or roll back to a shorter list);
        None, or the grammar's error (a token it does not allow)."""
        m, n = self.matcher, len(self.tokens)
        if self.consumed > n:
            back = self.consumed - n
            if not m.rollback(back):
                m.reset()
                self.consumed = 0
            else:
                self.consumed = n
        if self.consumed < n:
            if not m.consume_tokens(self.tokens[self.consumed:]):
                return m.get_error() or "a token the output grammar does not allow"
            self.consumed = n
        if m.is_error():
            return m.get_error()
        return None

    def fill_mask(self, ptr: int, nbytes: int) -> str | None:
        """`sync`, then write the allowed next tokens as a bitmask of `nbytes` bytes at
        `ptr` (int32 words, bit t % 32 of word t // 32 for token t; the model's EOS tokens
        only where the grammar accepts the output as complete). Returns None or why the
        request cannot go on."""
        why = self.sync()
        if why is not None:
            return why
        self.matcher.unsafe_compute_mask_ptr(ptr, nbytes)
        return self.matcher.get_error() if self.matcher.is_error() else None

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar (EOS may end it)."""
        self.sync()
        return bool(self.matcher.is_accepting())
