"""What EngineCore needs of a model runner (`service.worker.model_runner.ModelRunner` is one;
unit tests use fakes)."""

from __future__ import annotations

from typing import Protocol

from service.core.scheduler_output import RunnerOutput, SchedulerOutput


class Runner(Protocol):
    """Executes steps on one device's KV cache.

    num_blocks: device KV blocks; num_swap_blocks: CPU swap blocks (0: no swapping);
    max_model_len: context cap in tokens.
    """

    num_blocks: int
    num_swap_blocks: int
    max_model_len: int

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies, in that order."""
        ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Forget `out.finished_request_ids`, run the forward of `out.sequences` and sample
        those with `sample`. Raises whatever the device raises; a row whose own inputs
        fail (non-finite logits) is reported in `RunnerOutput.failed` instead."""
        ...
