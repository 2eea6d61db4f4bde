"""Which logits rows a step scores for logprobs, and their scores as `TokenLogprob`s.

Two kinds (the request's `SamplingParams.logprobs` and `prompt_logprobs`):
- a sampled token: its sampling row, the logits the sampler drew it from;
- a prompt token p + 1: the row of prompt position p, when p is in this step's chunk and
  p + 1 < the prompt's length (the last prompt position predicts the first sampled token,
  which is the first kind). The LM head runs on these rows too, after the sampling rows.

Scores come from `sampler.compute_logprobs`: log_softmax of the raw logits (the model's
own distribution, before temperature and the cuts; vLLM's "raw_logprobs").
Cost: nothing for a step in which no row asks; otherwise one log_softmax over the rows
that ask, and a topk of the largest K asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from protocol.messages import TokenLogprob
from service.core.scheduler_output import ScheduledSequence
from service.worker.sampler import TokenLogprobs, compute_logprobs

__all__ = ["PromptRows", "prompt_rows", "sampled_logprobs", "score_prompt_rows", "to_token_logprobs"]


class PromptRows(NamedTuple):
    """The prompt positions one step scores.

    rows: [R] int64 token rows of the step (indices into its flattened input ids).
    targets: [R] int64 the prompt token each row predicts.
    spans: (request id, first position p, number of rows, K) per sequence, in row order.
    """

    rows: Tensor
    targets: Tensor
    spans: list[tuple[str, int, int, int]]


def prompt_rows(seqs: Sequence[ScheduledSequence]) -> PromptRows | None:
    """The rows to score for the sequences that carry their prompt, or None (no row)."""
    if all(s.prompt_token_ids is None for s in seqs):
        return None
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    offset = 0
    for s in seqs:
        prompt = s.prompt_token_ids
        if prompt is not None and s.params.prompt_logprobs is not None:
            start = s.num_computed_tokens
            end = min(start + len(s.token_ids), len(prompt) - 1)  # positions [start, end)
            if end > start:
                rows.extend(range(offset, offset + end - start))
                targets.extend(prompt[start + 1:end + 1])
                spans.append((s.request_id, start, end - start, s.params.prompt_logprobs))
        offset += len(s.token_ids)
    if not rows:
        return None
    return PromptRows(torch.tensor(rows, dtype=torch.int64),
                      torch.tensor(targets, dtype=torch.int64), spans)


def score_prompt_rows(logits: Tensor, scored: PromptRows) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """request id -> (first position p, the scores of prompt tokens p + 1, p + 2, ...).

    logits: [R, V] the rows of `scored.rows`, in that order."""
    num_top = max(k for _, _, _, k in scored.spans)
    lps = to_token_logprobs(compute_logprobs(logits, scored.targets.to(logits.device), num_top))
    out: dict[str, tuple[int, list[TokenLogprob]]] = {}
    i = 0
    for rid, start, n, k in scored.spans:
        out[rid] = (start, [_top_k(lp, k, num_top) for lp in lps[i:i + n]])
        i += n
    return out


def sampled_logprobs(logits: Tensor, tokens: Tensor,
                     sampling: Sequence[ScheduledSequence]) -> dict[str, TokenLogprob]:
    """request id -> its sampled token's score, for the sequences whose params ask.

    logits: [S, V] the sampling rows; tokens: [S] int64 what `sample` drew from them."""
    asking = [i for i, s in enumerate(sampling) if s.params.logprobs is not None]
    if not asking:
        return {}
    num_top = max(sampling[i].params.logprobs for i in asking)  # type: ignore[type-var]
    idx = torch.tensor(asking, dtype=torch.int64, device=logits.device)
    lps = to_token_logprobs(compute_logprobs(logits[idx], tokens[idx], num_top))
    return {sampling[i].request_id: _top_k(lp, sampling[i].params.logprobs, num_top)
            for i, lp in zip(asking, lps)}


def to_token_logprobs(scores: TokenLogprobs) -> list[TokenLogprob]:
    """`sampler.TokenLogprobs` ([S] rows) as S `TokenLogprob`s (one device sync)."""
    token = scores.token.tolist()
    ids = scores.top_ids.tolist()
    top = scores.top.tolist()
    return [TokenLogprob(t, list(zip(i, v))) for t, i, v in zip(token, ids, top)]


def _top_k(lp: TokenLogprob, k: int | None, computed: int) -> TokenLogprob:
    return lp if k == computed else TokenLogprob(lp.logprob, lp.top[:k or 0])
