"""A step's logits -> its sampled tokens (RunnerOutput), in vLLM's order: the rows'
sampling params checked, the constrained rows' token masks (structured output, tool
calls), the logits processors, then greedy argmax or a batched sample; logprobs are
scored on the model's own distribution, before any mask or processor.

A row that cannot go on fails alone (`RunnerOutput.failed`): out-of-range params, a
grammar that cannot continue, non-finite logits. Holds the per-request state that lives
across steps: seeded requests' generators and repetition-penalised requests' prompt
tensors, both dropped with `forget` when the request finishes.
"""

from __future__ import annotations

import torch

from service.core.scheduler_output import RunnerOutput, ScheduledSequence
from service.worker.logits_processors import (RowHistory, apply_logits_processors,
                                              needs_prompt, plan_logits_processing)
from service.worker.logprob_rows import sampled_logprobs
from service.worker.sampler import (GREEDY_EPS, build_sampling_tensors, check_sampling_params,
                                   greedy_tokens, make_generator, sample)
from service.worker.section_timer import SectionTimer
from service.worker.token_mask import apply_token_masks_, fill_token_masks

__all__ = ["SamplingStep"]


class SamplingStep:
    """Samples the rows of a step's logits (float32 or the model's dtype, [S, V]).

    Args:
        eos_token_ids: the model's EOS ids (min_tokens holds them back).
        vocab_size: V.
    """

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab = vocab_size
        self._generators: dict[str, torch.Generator] = {}  # seeded requests, by request id
        # prompts as int64 tensors of requests with a repetition penalty, by request id
        self._prompt_ids: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: list[str] | set[str]) -> None:
        """Drop the finished requests' generators and prompt tensors."""
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._prompt_ids.pop(rid, None)

    def sample(self, sampling: list[ScheduledSequence], logits: torch.Tensor,
               prompt_lps: dict, tm: SectionTimer | None = None) -> RunnerOutput:
        """The step's output for the `sampling` sequences (row i of `logits` [S, V] is
        sequence i's last position) and the prompt logprobs already scored. Laps `tm`'s
        "sample" section when a timer is set."""
        failed: dict[str, str] = {}
        try:
            check_sampling_params([s.params for s in sampling])
        except ValueError:  # admission checks params: find the row, keep the others
            keep = []
            for i, s in enumerate(sampling):
                try:
                    check_sampling_params([s.params])
                    keep.append(i)
                except ValueError as e:
                    failed[s.request_id] = str(e)
            sampling = [sampling[i] for i in keep]
            logits = logits[keep]
            if not sampling:
                return RunnerOutput({}, failed, prompt_logprobs=prompt_lps)
        raw = logits  # logprobs are the model's own distribution, before any mask
        if any(s.constraint is not None for s in sampling):
            sampling, logits, raw = self._mask_constrained(sampling, logits, failed)
            if not sampling:
                return RunnerOutput({}, failed, prompt_logprobs=prompt_lps)
        masked_copy = raw is not logits  # the mask's copy holds the rows as the model gave them
        logits, processed_raw = self.logits_processors(logits, sampling)
        if not masked_copy:
            raw = processed_raw
        greedy = all(s.params.temperature is not None and s.params.temperature < GREEDY_EPS
                     for s in sampling)
        if greedy:  # no sampling tensors to build: one argmax a row
            token_tensor = greedy_tokens(logits)
        else:
            tensors = build_sampling_tensors([s.params for s in sampling], logits.device)
            token_tensor = sample(logits, *tensors, [self._generator(s) for s in sampling])
        tokens = token_tensor.tolist()
        lps = sampled_logprobs(raw, token_tensor, sampling)
        if tm is not None:
            tm.lap("sample")
        sampled = {}
        for s, t in zip(sampling, tokens):
            if t < 0:
                failed[s.request_id] = "the model's logits for this sequence are not finite"
            else:
                sampled[s.request_id] = t
        return RunnerOutput(sampled, failed, lps, prompt_lps)

    def logits_processors(self, logits: torch.Tensor, sampling: list[ScheduledSequence]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """THE step where per-row logits processors change the sampling logits [S, V]
        (float32, in place), before greedy argmax or `sample`: min_tokens, logit_bias and
        the penalties (`logits_processors`); a per-row token mask (structured output)
        comes just before it (`_mask_constrained`). Rows that ask for none are not touched,
        and nothing runs in a step where no row asks. Returns (the logits to sample from,
        those to score logprobs on: the raw ones, a copy made before processing only when a
        processed row asks for logprobs).
        """
        histories = [RowHistory(i, s.token_history[1], self._prompt_tensor(s), s.params)
                     for i, s in enumerate(sampling) if s.token_history is not None]
        if not histories:
            return logits, logits
        plan = plan_logits_processing(histories, self.eos_token_ids, self.vocab)
        if plan is None:
            return logits, logits
        raw = logits
        if logits.dtype != torch.float32:
            logits = logits.float()  # a new tensor: raw stays as it was
        elif any(sampling[i].params.logprobs is not None for i in plan.rows):
            raw = logits.clone()
        return apply_logits_processors(logits, plan), raw

    def _prompt_tensor(self, seq: ScheduledSequence) -> torch.Tensor | None:
        """A repetition-penalised request's prompt as int64 [P] (made once, kept until it
        finishes), else None."""
        if not needs_prompt(seq.params):
            return None
        ids = self._prompt_ids.get(seq.request_id)
        if ids is None:
            ids = self._prompt_ids[seq.request_id] = torch.tensor(seq.token_history[0],
                                                                  dtype=torch.int64)
        return ids

    def _mask_constrained(self, sampling: list[ScheduledSequence], logits: torch.Tensor,
                          failed: dict[str, str]) -> tuple[list[ScheduledSequence],
                                                           torch.Tensor, torch.Tensor]:
        """Mask the constrained rows' logits (structured output, tool calls) in one batched
        call (`service.worker.token_mask`); a row whose grammar cannot go on fails alone.

        Returns (the rows still sampling, their logits [B', V] masked, the same rows
        unmasked for logprobs). Only the constrained rows are read or written, plus a copy
        of the logits when a constrained row asks for logprobs."""
        idx = [i for i, s in enumerate(sampling) if s.constraint is not None]
        masks, bad = fill_token_masks([sampling[i].constraint for i in idx],  # type: ignore[misc]
                                      logits.shape[1])
        if bad:
            for j, why in bad.items():
                failed[sampling[idx[j]].request_id] = f"structured output: {why}"
            keep_c = [j for j in range(len(idx)) if j not in bad]
            masks = masks[keep_c]
            dropped = {idx[j] for j in bad}
            keep = [i for i in range(len(sampling)) if i not in dropped]
            position = {old: new for new, old in enumerate(keep)}
            idx = [position[idx[j]] for j in keep_c]
            sampling = [sampling[i] for i in keep]
            logits = logits[keep]
        raw = logits
        if any(sampling[i].params.logprobs is not None for i in idx):
            raw = logits.clone()
        rows = None if len(idx) == len(sampling) else torch.tensor(idx, device=logits.device)
        apply_token_masks_(logits, rows, masks)
        return sampling, logits, raw

    def _generator(self, seq: ScheduledSequence) -> torch.Generator | None:
        """The request's own generator when it has a seed (made on its first sample)."""
        seed = seq.params.seed
        if seed is None:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = make_generator(seed)
        return gen
