"""Engine `TokenLogprob`s as OpenAI's `logprobs` objects (pure).

Chat (`choices[].logprobs`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}, the `top_logprobs` most likely tokens
exactly, as OpenAI's reference gives them.

Completions (the legacy shape, `choices[].logprobs`): {"tokens", "token_logprobs",
"top_logprobs", "text_offset"}, one entry per token. Each `top_logprobs` entry maps the
`logprobs` most likely token strings, and the chosen token's own, to their logprobs
(OpenAI's "as well as the chosen tokens"; vLLM does the same); with `echo` the prompt's
tokens come first, the first of them with null (nothing predicts it). `text_offset` is
each token's character offset in the choice's text, counted over the token strings as
vLLM counts it. lm-eval's loglikelihood tasks read `token_logprobs` and `top_logprobs`.

A token's string is `tokenizer.decode([id])` (a piece of a multi-byte character shows as
U+FFFD, as in vLLM). -inf (probability 0) is sent as -9999.0, vLLM's stand-in: JSON has
no infinity.
"""

from __future__ import annotations

import math
from typing import Any

from protocol.messages import TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs", "vllm_prompt_logprobs"]

FLOOR = -9999.0


def _finite(x: float) -> float:
    return x if x > FLOOR or math.isnan(x) else FLOOR


class TokenTexts:
    """id -> its decoded string, cached (the vocabulary is small and tokens repeat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob),
            "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(ids: list[int], lps: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """{"content": [...]} for generated tokens `ids`, one TokenLogprob each."""
    content = []
    for token_id, lp in zip(ids, lps):
        entry = _chat_entry(texts(token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_entry(texts(t), v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(ids: list[int], lps: list[TokenLogprob | None], texts: TokenTexts,
                        offset: int = 0) -> tuple[dict[str, Any], int]:
    """The legacy `logprobs` object for tokens `ids` (None: an unscored first prompt
    token), their text offsets starting at `offset`; returns it and the offset after."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lp in zip(ids, lps):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        top = {texts(t): _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}, offset


def vllm_prompt_logprobs(ids: list[int], lps: list[TokenLogprob | None], texts: TokenTexts,
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing predicts
    it), else {str(token id): {"logprob", "rank", "decoded_token"}} holding the prompt's
    own token and the `num_top` most likely ones. rank: 1 for the most likely; the prompt
    token's rank is known only when it is among those shown (else null)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in zip(ids, lps):
        if lp is None:
            out.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for rank, (t, v) in enumerate(lp.top[:num_top], start=1):
            entry[str(t)] = {"logprob": _finite(v), "rank": rank, "decoded_token": texts(t)}
        if str(token_id) not in entry:
            rank = next((r for r, (t, _) in enumerate(lp.top, start=1) if t == token_id), None)
            entry = {str(token_id): {"logprob": _finite(lp.logprob), "rank": rank,
                                     "decoded_token": texts(token_id)}, **entry}
        out.append(entry)
    return out
