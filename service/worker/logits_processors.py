"""Per-row logits processors applied before sampling: min_tokens, logit_bias, penalties.

What each does (vLLM's semantics and order, its V1 sampler's steps 5 and 6):

1. min_tokens: while a row's completion has fewer than `min_tokens` tokens, the logits
   of its stop tokens (the model's EOS ids unless `ignore_eos`, and its `stop_token_ids`)
   are set to -inf, so neither greedy nor random sampling can end it early.
2. logit_bias: each {token id: bias} entry is added to that token's logit.
3. penalties, on the logits after 1 and 2:
   - repetition_penalty r (Keskar et al., "CTRL: A Conditional Transformer Language Model
     for Controllable Generation", 2019; transformers' and vLLM's form): the logit l of
     every token in the prompt or the completion becomes l / r where l > 0, l * r where
     not (r > 1 makes repeats less likely whatever the logit's sign);
   - frequency_penalty f: l -= f * (times the token occurs in the completion);
   - presence_penalty p: l -= p where it occurs at least once (OpenAI's formula).

Every step is done on the rows that ask only, as whole-tensor operations over those rows
(an index_put / scatter_add over their token ids, elementwise maths over [S, V]): never a
Python loop over the vocabulary, and the rows that ask for nothing are not read or written.
Each row's result depends on its own logits and parameters alone (elementwise ops), so a
row's tokens do not depend on its batch neighbours (`--batch-invariant` holds).

The temperature, top-k, top-p, min-p cuts and the draw come after, in `sampler.sample`;
greedy rows take the argmax of the processed logits (as vLLM's greedy sampling does).
Logprobs stay raw (the model's distribution before any of this; vLLM's default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["RowHistory", "LogitsProcessing", "plan_logits_processing", "apply_logits_processors",
           "needs_processing"]


class RowHistory(NamedTuple):
    """What one sampling row's processors read (all optional but `row`).

    row: index of the row in the step's [S, V] sampling logits.
    output_token_ids: the completion so far (the request's own list, read only).
    prompt_ids: the prompt as an int64 [P] tensor (only where repetition_penalty != 1).
    params: the request's SamplingParams (presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, min_tokens, stop_token_ids, ignore_eos).
    """

    row: int
    output_token_ids: Sequence[int]
    prompt_ids: Tensor | None
    params: object


class LogitsProcessing(NamedTuple):
    """One step's processing, built by `plan_logits_processing` (tensors on the CPU).

    mask_rows, mask_ids: [M] int64 (row, token) pairs set to -inf (min_tokens).
    bias_rows, bias_ids: [N] int64, bias_values: [N] float32 (logit_bias).
    penalty_rows: [R] int64 rows with a penalty; presence, frequency, repetition: [R]
        float32; output_rows, output_ids: [O] int64 (local row in 0..R-1, token) once per
        completion token; prompt_rows, prompt_ids: [Q] int64 the same for prompt tokens
        (repetition rows only). None where no row has that kind.
    """

    mask_rows: Tensor | None
    mask_ids: Tensor | None
    bias_rows: Tensor | None
    bias_ids: Tensor | None
    bias_values: Tensor | None
    penalty_rows: Tensor | None
    presence: Tensor | None
    frequency: Tensor | None
    repetition: Tensor | None
    output_rows: Tensor | None
    output_ids: Tensor | None
    prompt_rows: Tensor | None
    prompt_ids: Tensor | None

    @property
    def rows(self) -> set[int]:
        """Every row this processing writes."""
        out: set[int] = set()
        for t in (self.mask_rows, self.bias_rows, self.penalty_rows):
            if t is not None:
                out.update(t.tolist())
        return out


def _penalised(params: object) -> bool:
    rep = getattr(params, "repetition_penalty", None)
    return bool(getattr(params, "presence_penalty", 0.0) or getattr(params, "frequency_penalty", 0.0)
                or (rep is not None and rep != 1.0))


def needs_processing(params: object) -> bool:
    """Whether a request's params ask for any processor here (cheap; read per request)."""
    return bool(_penalised(params) or getattr(params, "logit_bias", None)
                or getattr(params, "min_tokens", 0))


def needs_prompt(params: object) -> bool:
    """Whether its processors read the prompt (a repetition penalty other than 1)."""
    rep = getattr(params, "repetition_penalty", None)
    return rep is not None and rep != 1.0


def _ids(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def plan_logits_processing(rows: Sequence[RowHistory], eos_token_ids: Sequence[int],
                           vocab_size: int) -> LogitsProcessing | None:
    """The step's processing for `rows` (those whose params need any), or None (nothing).

    Token ids outside [0, vocab_size) are skipped (admission refuses them in logit_bias and
    stop_token_ids; a model whose EOS id is past its LM head cannot sample it anyway).
    Cost: Python work per row proportional to its logit_bias entries, stop ids and
    completion length (the prompt is the caller's cached tensor).
    """
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    pen_rows: list[int] = []
    presence: list[float] = []
    frequency: list[float] = []
    repetition: list[float] = []
    out_rows: list[int] = []
    out_ids: list[int] = []
    prompt_parts: list[Tensor] = []
    prompt_local: list[Tensor] = []
    for h in rows:
        p = h.params
        if len(h.output_token_ids) < getattr(p, "min_tokens", 0):
            stops = set(getattr(p, "stop_token_ids", ()))
            if not getattr(p, "ignore_eos", False):
                stops.update(eos_token_ids)
            ids = sorted(t for t in stops if 0 <= t < vocab_size)
            mask_rows.extend([h.row] * len(ids))
            mask_ids.extend(ids)
        bias: Mapping[int, float] | None = getattr(p, "logit_bias", None)
        if bias:
            for t, b in bias.items():
                if 0 <= int(t) < vocab_size:
                    bias_rows.append(h.row)
                    bias_ids.append(int(t))
                    bias_values.append(float(b))
        if _penalised(p):
            local = len(pen_rows)
            pen_rows.append(h.row)
            presence.append(float(p.presence_penalty))
            frequency.append(float(p.frequency_penalty))
            rep = p.repetition_penalty
            repetition.append(1.0 if rep is None else float(rep))
            out = [t for t in h.output_token_ids if 0 <= t < vocab_size]
            out_rows.extend([local] * len(out))
            out_ids.extend(out)
            if needs_prompt(p) and h.prompt_ids is not None and h.prompt_ids.numel():
                prompt_parts.append(h.prompt_ids)
                prompt_local.append(torch.full_like(h.prompt_ids, local))
    if not (mask_rows or bias_rows or pen_rows):
        return None
    f32 = torch.float32
    return LogitsProcessing(
        _ids(mask_rows) if mask_rows else None, _ids(mask_ids) if mask_rows else None,
        _ids(bias_rows) if bias_rows else None, _ids(bias_ids) if bias_rows else None,
        torch.tensor(bias_values, dtype=f32) if bias_rows else None,
        _ids(pen_rows) if pen_rows else None,
        torch.tensor(presence, dtype=f32) if pen_rows else None,
        torch.tensor(frequency, dtype=f32) if pen_rows else None,
        torch.tensor(repetition, dtype=f32) if pen_rows else None,
        _ids(out_rows) if pen_rows else None, _ids(out_ids) if pen_rows else None,
        torch.cat(prompt_local) if prompt_parts else None,
        torch.cat(prompt_parts).clamp(0, vocab_size - 1) if prompt_parts else None)


def apply_logits_processors(logits: Tensor, plan: LogitsProcessing) -> Tensor:
    """Apply `plan` to float32 `logits` [S, V] in place (min_tokens, logit_bias, then the
    penalties, vLLM's order) and return it. Rows not in the plan are untouched."""
    dev = logits.device
    if plan.mask_rows is not None:
        logits.index_put_((plan.mask_rows.to(dev), plan.mask_ids.to(dev)),
                          torch.tensor(float("-inf"), device=dev))
    if plan.bias_rows is not None:
        logits.index_put_((plan.bias_rows.to(dev), plan.bias_ids.to(dev)),
                          plan.bias_values.to(dev), accumulate=True)
    if plan.penalty_rows is not None:
        rows = plan.penalty_rows.to(dev)
        logits[rows] = apply_penalties(logits[rows], plan, dev)
    return logits


def apply_penalties(sub: Tensor, plan: LogitsProcessing, dev: torch.device) -> Tensor:
    """The penalties on the [R, V] logits of the plan's penalty rows (a copy, changed in place)."""
    num_rows, vocab = sub.shape
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)  # [R, V]
    if plan.output_ids.numel():
        counts.index_put_((plan.output_rows.to(dev), plan.output_ids.to(dev)),
                          torch.ones(plan.output_ids.shape[0], device=dev), accumulate=True)
    in_output = counts > 0  # [R, V]
    seen = in_output
    if plan.prompt_ids is not None:
        seen = in_output.clone()
        seen[plan.prompt_rows.to(dev), plan.prompt_ids.to(dev)] = True
    repetition = plan.repetition.to(dev).unsqueeze(1)  # [R, 1]
    factor = torch.where(seen, repetition, 1.0)  # [R, V]
    sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub -= plan.frequency.to(dev).unsqueeze(1) * counts
    sub -= plan.presence.to(dev).unsqueeze(1) * in_output
    return sub
