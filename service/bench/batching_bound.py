"""The most continuous batching can gain over static batching in output tokens/s, on
a machine where a decode step costs the same whatever its batch size (the GPU ideal
the classic diagrams assume; prefill counted as free in both modes).

Both modes then emit the same tokens, so their throughput ratio is the ratio of
their step counts. The load is `scripts/bench`'s closed loop: requests in workload
order, all arrived at the start, at most `max_concurrency` outstanding (a client
sends the next request when one finishes), at most `max_num_seqs` in a batch.

- continuous: before every step the batch takes waiting requests up to max_num_seqs;
  a request that finishes leaves at once and its client's next request joins the
  next step.
- static: a batch is whatever is waiting when the previous batch ends (up to
  max_num_seqs) and runs until its longest member finishes (Orca, OSDI '22, sec. 2:
  "request-level scheduling").

Used to state how far a measured continuous/static ratio is from what these
workloads allow at all (README, Performance; docs/perf/HISTORY.md). Pure: no engine, no timing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchingBound:
    """Decode steps of each mode for one workload; ratio = static / continuous (>= 1 here)."""

    continuous_steps: int
    static_steps: int

    @property
    def ratio(self) -> float:
        return self.static_steps / self.continuous_steps if self.continuous_steps else 1.0


def batching_bound(output_lens: Sequence[int], *, max_num_seqs: int,
                   max_concurrency: int | None = None) -> BatchingBound:
    """Steps under continuous and static batching at a constant cost per step.

    Args:
        output_lens: output tokens of each request, in the order they are sent (>= 1 each).
        max_num_seqs: most sequences in one step (>= 1).
        max_concurrency: most outstanding requests (None: all at once).

    Raises:
        ValueError: an output length or max_num_seqs < 1, or max_concurrency < 1.
    """
    if max_num_seqs < 1 or (max_concurrency is not None and max_concurrency < 1):
        raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_concurrency "
                         f"({max_concurrency}) must be >= 1")
    if any(n < 1 for n in output_lens):
        raise ValueError("every output length must be >= 1")
    return BatchingBound(_run(output_lens, max_num_seqs, max_concurrency, static=False),
                         _run(output_lens, max_num_seqs, max_concurrency, static=True))


def _run(output_lens: Sequence[int], slots: int, concurrency: int | None, static: bool) -> int:
    pending = deque(output_lens)  # not sent yet
    first = len(pending) if concurrency is None else concurrency
    waiting = deque(pending.popleft() for _ in range(min(first, len(pending))))
    running: list[int] = []  # tokens left of each sequence in the batch
    steps = 0
    while waiting or running:
        if not static or not running:  # static: only an idle engine forms a batch
            while waiting and len(running) < slots:
                running.append(waiting.popleft())
        steps += 1
        left = [r - 1 for r in running]
        running = [r for r in left if r > 0]
        for _ in range(len(left) - len(running)):  # each finish sends the client's next one
            if pending:
                waiting.append(pending.popleft())
    return steps
