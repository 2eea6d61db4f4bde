"""Scheduling policies: pure orderings the scheduler asks, no I/O, no state of the pool.

A policy answers two questions:
- `waiting_key(req, now)`: the order in which waiting requests are admitted
  (smaller first). Preempted requests always come before never-run ones; the
  scheduler adds that rule on top of the key.
- `victim_key(req, now)`: which running request to preempt when blocks run short
  (the largest key is preempted first).
"""

from __future__ import annotations

from service.request import Request


class FCFSPolicy:
    """First come, first served: admit in arrival order; preempt the newest arrival.

    Starvation-free: the oldest request is never a victim while a newer one runs,
    and a preempted request is resumed before anything new is admitted.
    """

    name = "fcfs"

    def waiting_key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time,)

    def victim_key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time,)


POLICIES = {"fcfs": FCFSPolicy}


def make_policy(name: str, **options: float) -> FCFSPolicy:
    """A policy by name; raises ValueError for an unknown one."""
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name](**options)
