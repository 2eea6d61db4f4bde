"""The only contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protocol import SamplingParams


class ScheduledSequence(NamedTuple):
    """One sequence's share of a step (a NamedTuple: built for every sequence every step).

    token_ids: the tokens whose K/V this step computes, [n] (a prefill chunk, or 1 for a decode).
    num_computed_tokens: tokens of this sequence already in the KV cache before them.
    block_table: the sequence's KV block ids, covering num_computed_tokens + n tokens (the
        request's own list: read it, never change it; valid until the next schedule()).
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
    """What one step does, in this order: swap out, swap in, copy blocks, forward.

    swap_out: (device block, CPU block) pairs to copy to CPU before anything else.
    swap_in: (CPU block, device block) pairs to copy back.
    copy_blocks: (source, destination) device blocks for copy-on-write.
    preempted: request ids preempted while building this step.
    """

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.sequences or self.swap_out or self.swap_in or self.copy_blocks)
