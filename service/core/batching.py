"""Batching modes: who may start a step's prefill (continuous, static, dynamic).

- continuous (Orca, OSDI 2022): every waiting request may start, every
  `schedule_interval` steps (and whenever nothing runs);
- static: a batch of up to `max_num_seqs` forms when the previous one has finished,
  and only its members start (their ends are held back by EngineCore until the
  whole batch is done, as a static batch's results come back together);
- dynamic (Triton Inference Server's dynamic batcher): static, but a batch forms only
  once `max_num_seqs` requests wait or the oldest has waited `max_queue_delay_ms`.

Pure and synchronous: the scheduler asks, nothing here allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.core.config import SchedulerConfig
from service.core.request import Request

__all__ = ["BatchFormer"]


class BatchFormer:
    """The batch in flight (static and dynamic modes) and who may start now."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.batch: set[str] = set()  # request ids of the batch in flight

    @property
    def in_flight(self) -> bool:
        """True while members of the current static/dynamic batch are unfinished."""
        return bool(self.batch)

    def discard(self, request_id: str) -> None:
        """A member finished (or was cancelled)."""
        self.batch.discard(request_id)

    def idle_until(self, waiting: Sequence[Request]) -> float | None:
        """When an empty step could turn non-empty without new input (a dynamic batch's
        queue delay running out), in clock seconds; None when only new input can."""
        if self.config.batching != "dynamic" or self.batch or not waiting:
            return None
        oldest = min(r.arrival_time for r in waiting)
        return oldest + self.config.max_queue_delay_ms / 1000.0

    def candidates(self, order: list[Request], num_running: int, num_schedule_calls: int,
                   now: float) -> list[Request]:
        """Of the waiting requests in policy order, those that may start this step."""
        mode = self.config.batching
        if mode == "continuous":
            if num_running and num_schedule_calls % self.config.schedule_interval:
                return []
            return order
        if not self.batch:
            due = self.idle_until(order)
            if mode == "dynamic" and len(order) < self.config.max_num_seqs \
                    and due is not None and now < due:
                return []
            self.batch = {r.request_id for r in order[:self.config.max_num_seqs]}
        return [r for r in order if r.request_id in self.batch]
