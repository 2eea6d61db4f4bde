"""The only contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol import SamplingParams


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    token_ids: the tokens whose K/V this step computes, [n] (a prefill chunk, or 1 for a decode).
    num_computed_tokens: tokens of this sequence already in the KV cache before them.
    block_table: the sequence's KV block ids, covering num_computed_tokens + n tokens.
    sample: True when this chunk reaches the sequence's last token, so a new token is sampled.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True)
class SchedulerOutput:
    """What one forward computes. `preempted` lists request ids preempted while building it."""

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.sequences
