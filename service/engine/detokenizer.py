"""Incremental detokenization of one request's output, with stop strings.

Turns the token ids a request generates, a few at a time, into text deltas
that obey the wire protocol (PROTOCOL.md, `delta`):

- every delta is valid UTF-8 and never part of a character: a byte-level BPE
  token can end inside a multi-byte character (emoji, CJK), and its decode then
  ends in U+FFFD; such text is held back until a later token completes it;
- text that may still turn into a stop string is held back until it is known
  not to; the stop string itself, and everything after it, is never emitted.

Decoding uses the prefix/read offset technique of vLLM's and TGI's incremental
detokenizers (the same one `tokenizers.decoders.DecodeStream` runs in Rust):
decode a short window of ids that starts with already-emitted tokens, and emit
the part of its text that lies beyond the decode of those already-emitted
tokens. Decoding with left context is what keeps the leading space of a word
for SentencePiece-style decoders (Metaspace, `Strip`), which drop the space of
the first token of any decode. The window starts as the tail of the prompt, so
the first output token keeps its space too. (DecodeStream itself is not used:
it cannot flush held-back bytes, it keeps skipped special tokens in its window,
and with a prompt that ends inside a character it re-emits prompt text. It is
about 0.6 us/token faster; both are far under the per-token budget.)

The concatenation of all emitted text (`step` texts plus `flush`) equals the
tokenizer's own decode of all output ids (`tokenizer.decode(output_ids,
skip_special_tokens=...)` for a byte-level tokenizer such as SmolLM2's; for a
SentencePiece one it is the same text seen after the prompt, i.e. with the
first token's leading space) cut before the first stop string. The
transformers-level `clean_up_tokenization_spaces` post-processing is not
applied (it is off for BPE tokenizers, and it is not incremental).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tokenizers import Tokenizer

__all__ = ["DetokenizerStep", "IncrementalDetokenizer"]

# Prompt tokens kept as left context for the first output token (vLLM uses 5).
# More than one, so that a prompt tail that starts inside a multi-byte character
# still gives a clean decode at its end.
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class DetokenizerStep(NamedTuple):
    """The result of one `IncrementalDetokenizer.step`.

    text: newly releasable text (may be ""), valid UTF-8, never a partial character.
    stop_hit: the stop string that ended the output in this step, else None.
    """

    text: str
    stop_hit: str | None


def _backend_of(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself).

    Raises TypeError for a tokenizer without a `tokenizers` backend.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"IncrementalDetokenizer needs a `tokenizers.Tokenizer` or a transformers tokenizer "
        f"with a `backend_tokenizer`, got {type(tokenizer).__name__}"
    )


def _special_ids(backend: Tokenizer) -> frozenset[int]:
    """Ids of the added tokens marked special: the ones `skip_special_tokens` drops."""
    return frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)


class IncrementalDetokenizer:
    """Streams one request's output ids as text, holding back partial characters and stop-string prefixes.

    Args:
        tokenizer: a transformers fast tokenizer (its `backend_tokenizer` is used
            directly) or a `tokenizers.Tokenizer`.
        prompt_token_ids: the request's prompt ids; the last few serve as left
            context so that the first output token decodes as it reads after the prompt.
        stop: stop strings (non-empty); output ends before the first occurrence of any.
        skip_special_tokens: drop special tokens (EOS, `<|im_end|>`, ...) from the text.
        min_tokens: the text of the first min_tokens ids is released without a search
            for stop strings (vLLM's `min_tokens`: they cannot end the output that early).

    Raises:
        TypeError: the tokenizer has no `tokenizers` backend.
        ValueError: a stop string is empty or a prompt id is negative.

    Cost: one backend decode of a window of a few ids per step, plus one more each
    time text is released; stop-string checks scan only the held-back text.
    Not thread-safe; one instance per request.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not a single string")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._backend = _backend_of(tokenizer)
        self._skip_special = skip_special_tokens
        self._special = _special_ids(self._backend) if skip_special_tokens else frozenset()
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._stop_first_chars = frozenset(s[0] for s in self._stop)
        # vLLM's min_tokens: no stop string is looked for in the text of the first
        # min_tokens output tokens (it is released as it comes)
        self._min_tokens = min_tokens
        self._num_tokens = 0

        # Decode window: ids[:read] are already emitted (or prompt) context whose
        # text is `_prefix_text`; ids[read:] are not yet released.
        #   ids:  [ context ...... | unreleased ... ]
        #                          ^ read
        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if t not in self._special]
        if any(t < 0 for t in context):
            raise ValueError(f"prompt token ids must be >= 0, got {context}")
        self._ids: list[int] = context
        self._prefix_text = self._decode(context)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its tail cannot serve as clean
            # context, so decode the output on its own, as `tokenizer.decode` would.
            self._ids = []
            self._prefix_text = ""
        self._read = len(self._ids)

        self._pending = ""  # decoded, held back because it may start a stop string
        self._emitted: list[str] = []
        self._stop_hit: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far (by `step` and `flush`)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_hit

    @property
    def finished(self) -> bool:
        """True after a stop string was hit or `flush` was called; `step` then raises."""
        return self._finished

    def step(self, new_token_ids: list[int]) -> DetokenizerStep:
        """Add newly generated ids; return the text that can be released now.

        The ids are taken one at a time, as if generated one per step: once a stop
        string completes, the ids after it are ignored, the text before the stop
        string's first occurrence is returned with `stop_hit` set, and the
        detokenizer is finished. When several stop strings occur, the one that
        starts earliest wins (ties: the shorter one).

        Raises:
            RuntimeError: called after a stop string was hit or after `flush`.
            ValueError: a negative token id.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.step called after the output finished")
        released: list[str] = []
        for token_id in new_token_ids:
            if token_id < 0:
                raise ValueError(f"token ids must be >= 0, got {token_id}")
            self._num_tokens += 1
            if token_id in self._special:
                continue  # decodes to nothing and would only widen the window
            new_text = self._decode_new(token_id)
            if not new_text:
                continue
            if self._num_tokens <= self._min_tokens:  # not searched for stop strings
                released.append(new_text)
                continue
            text, stop_hit = self._add_text(new_text)
            released.append(text)
            if stop_hit is not None:
                return self._finish_step("".join(released), stop_hit)
        return self._finish_step("".join(released), None)

    def flush(self) -> str:
        """Release everything held back; the output has ended for another reason (length, EOS, cancel).

        Releases text held back as a possible stop-string start, and the decode of
        ids that end inside a character (as `tokenizer.decode` renders them, with
        U+FFFD). A stop string completed by that last text still cuts it. Returns ""
        when already finished (after a stop string or an earlier flush).
        """
        if self._finished:
            return ""
        tail = self._decode(self._ids)[len(self._prefix_text) :] if self._read < len(self._ids) else ""
        text = self._pending + tail
        cut = self._find_stop(text)
        if cut is not None:
            self._stop_hit = cut[1]
            text = text[: cut[0]]
        self._pending = ""
        self._finished = True
        if text:
            self._emitted.append(text)
        return text

    # -- internals ---------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, token_id: int) -> str:
        """Append one id to the window; return the text it completes ("" inside a character)."""
        ids = self._ids
        ids.append(token_id)
        full = self._decode(ids)
        # E.g. prefix " world" (ids[:read]), full " world 😀": release " 😀". A full
        # decode ending in U+FFFD ends inside a character: wait for more ids.
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full[len(self._prefix_text) :]
        # Slide the window: the ids just released become the next left context.
        del ids[: self._read]
        self._read = len(ids)
        self._prefix_text = self._decode(ids)
        return new_text

    def _add_text(self, new_text: str) -> tuple[str, str | None]:
        """Run decoded text through the stop-string filter; return (releasable text, stop hit)."""
        if not self._stop:
            return new_text, None
        text = self._pending + new_text
        cut = self._find_stop(text)
        if cut is not None:
            self._pending = ""
            return text[: cut[0]], cut[1]
        hold = self._held_suffix_len(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest stop occurrence in text (ties: shorter), or None."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        return None if best is None else (best[0], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string.

        Holding back the longest such suffix keeps every possible future
        occurrence of a stop string inside the held-back text.
        E.g. stop "</s>", text "a <": hold 1 ("<"); text "a </": hold 2.
        """
        n = len(text)
        longest_stop = max(len(s) for s in self._stop)
        for start in range(max(0, n - longest_stop + 1), n):
            if text[start] in self._stop_first_chars:
                suffix = text[start:]
                if any(s.startswith(suffix) for s in self._stop):
                    return n - start
        return 0

    def _finish_step(self, text: str, stop_hit: str | None) -> DetokenizerStep:
        if stop_hit is not None:
            self._stop_hit = stop_hit
            self._finished = True
        if text:
            self._emitted.append(text)
        return DetokenizerStep(text, stop_hit)
