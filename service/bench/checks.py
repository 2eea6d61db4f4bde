"""Did a request receive exactly its own tokens? Checked frame by frame as they arrive.

For request `b7` asking max_tokens=4 under ignore_eos, a correct stream is e.g.

    delta id=b7 index=0 [t0]      delta id=b7 index=1 [t1, t2]   (merged: fine)
    delta id=b7 index=3 [t3]      done  id=b7 finish=length completion_tokens=4

Problems found: a frame for another id, an index that is not the running token count
(a gap, a repeat, another request's tokens interleaved), a done whose completion_tokens
differs from the tokens received, a prompt_tokens differing from the prompt sent, and
under ignore_eos a count other than max_tokens or a finish_reason other than "length".
"""

from __future__ import annotations

from protocol import Delta, Done
from service.bench.request_spec import RequestSpec

MAX_PROBLEMS = 5


class StreamCheck:
    """Checks the frames of one request. Feed `delta()` each Delta, then `done()` the Done.

    Args:
        spec: the request as sent.
        ignore_eos: whether it was sent with ignore_eos (then exactly max_tokens are due).
    """

    def __init__(self, spec: RequestSpec, ignore_eos: bool) -> None:
        self.spec = spec
        self.ignore_eos = ignore_eos
        self.tokens = 0
        self.problems: list[str] = []

    def _problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def delta(self, d: Delta) -> None:
        if d.id != self.spec.id:
            self._problem(f"delta for id {d.id!r} on request {self.spec.id!r}")
        if d.index != self.tokens:
            self._problem(f"delta index {d.index}, expected {self.tokens}")
        if not d.token_ids:
            self._problem(f"delta at index {d.index} carries no token ids")
        self.tokens += len(d.token_ids)

    def done(self, d: Done) -> list[str]:
        """Final checks; returns every problem found (empty when the stream was right)."""
        spec = self.spec
        if d.id != spec.id:
            self._problem(f"done for id {d.id!r} on request {spec.id!r}")
        if d.finish_reason in ("error", "cancelled"):
            self._problem(f"finish_reason {d.finish_reason!r}")
        if d.usage.completion_tokens != self.tokens:
            self._problem(f"usage.completion_tokens {d.usage.completion_tokens} != "
                          f"{self.tokens} tokens received")
        if d.usage.prompt_tokens != spec.input_len:
            self._problem(f"usage.prompt_tokens {d.usage.prompt_tokens} != "
                          f"{spec.input_len} prompt tokens sent")
        if self.ignore_eos:
            if self.tokens != spec.max_tokens:
                self._problem(f"{self.tokens} tokens received under ignore_eos, "
                              f"max_tokens {spec.max_tokens}")
            if d.finish_reason != "length":
                self._problem(f"finish_reason {d.finish_reason!r} under ignore_eos, expected 'length'")
        elif self.tokens > spec.max_tokens:
            self._problem(f"{self.tokens} tokens received, more than max_tokens {spec.max_tokens}")
        return list(self.problems)
