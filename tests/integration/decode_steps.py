"""Hand-built steps on a ModelRunner, for the fused-forward tests: prefill some prompts, then
run one decode step of all of them through the fused or the unfused forward."""

from __future__ import annotations

import torch

from protocol import SamplingParams
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0)  # the decode steps' inputs are the same every run


def prefill(runner, prompts: list[list[int]]) -> list[ScheduledSequence]:
    """Prefill each prompt (unfused: a prefill step), return their next decode steps
    (each fed its prompt's greedy next token)."""
    decodes, block = [], 0
    for i, ids in enumerate(prompts):
        blocks = list(range(block, block + runner.blocks_needed(len(ids) + 4)))
        block += len(blocks)
        seq = ScheduledSequence(f"r{i}", ids, 0, blocks, True, GREEDY)
        tok = runner.execute(SchedulerOutput([seq], len(ids))).sampled[f"r{i}"]
        decodes.append(ScheduledSequence(f"r{i}", [tok], len(ids), blocks, True, GREEDY))
    return decodes


def forward(runner, seqs: list[ScheduledSequence], fused: bool) -> torch.Tensor:
    """Logits [S, V] of one step of `seqs`, through the fused forward or not (K/V stored)."""
    ids, pos, meta, last = runner.prepare_inputs(SchedulerOutput(seqs, len(seqs)))
    saved, runner.model.fused = runner.model.fused, runner.model.fused if fused else {}
    try:
        return runner.model.forward(ids, pos, meta, runner.kv_caches, last)
    finally:
        runner.model.fused = saved


def both_forwards(runner, seqs: list[ScheduledSequence], first_fused: bool) -> tuple[
        list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One step of `seqs` through one forward (fused if `first_fused`), then through the
    other from the same cache: (the caches before, the first logits [S, V], the caches after
    the first, the second logits [S, V]). The runner's caches hold the second's K/V after."""
    before = [kv.clone() for kv in runner.kv_caches]
    first = forward(runner, seqs, fused=first_fused)
    after_first = [kv.clone() for kv in runner.kv_caches]
    for kv, b in zip(runner.kv_caches, before):
        kv.copy_(b)
    return before, first, after_first, forward(runner, seqs, fused=not first_fused)
