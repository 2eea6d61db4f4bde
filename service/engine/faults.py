"""Fault injection for tests: make a real step fail where a real bug would.

`Engine.inject_fault(where, request_id, count)` raises, inside the real code path:
- "schedule": in the scheduling policy's arithmetic for that request (as a field
  that overflows it would), so `schedule()` raises mid-way;
- "execute": in the model runner's forward of any batch holding that request (or
  of the next batches, request_id None: a transient device fault);
- "output": in the output processing (detokenizing) of that request's tokens.
Each fault fires `count` times (None: every time, like a bug in that request's
data). Production code never arms one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.core.scheduler_output import RunnerOutput, SchedulerOutput

WHERE = ("schedule", "execute", "output")


class InjectedFault(RuntimeError):
    """Raised by an armed fault (test-only)."""


@dataclass
class Fault:
    where: str
    request_id: str | None  # engine key or client id; None: any
    count: int | None

    def matches(self, key: str) -> bool:
        rid = self.request_id
        return rid is None or key == rid or key.endswith("/" + rid)


class FaultPlan:
    """The armed faults of one engine."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []

    def arm(self, where: str, request_id: str | None, count: int | None) -> None:
        if where not in WHERE:
            raise ValueError(f"where must be one of {', '.join(WHERE)}, got {where!r}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.faults.append(Fault(where, request_id, count))

    def fire(self, where: str, keys: list[str]) -> None:
        """Raise InjectedFault if an armed fault of `where` matches one of `keys`."""
        for f in self.faults:
            if f.where == where and any(f.matches(k) for k in keys):
                if f.count is not None:
                    f.count -= 1
                    if f.count == 0:
                        self.faults.remove(f)
                raise InjectedFault(f"injected {where} fault (Engine.inject_fault, test-only)")


class FaultyRunner:
    """A runner whose forward fires the plan's "execute" faults first."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        self._inner.apply_block_ops(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._plan.faults and out.sequences:
            self._plan.fire("execute", [s.request_id for s in out.sequences])
        return self._inner.execute(out)


class FaultyPolicy:
    """A scheduling policy whose keys fire the plan's "schedule" faults for their request."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def waiting_key(self, req: Any, now: float) -> tuple:
        self._plan.fire("schedule", [req.request_id])
        return self._inner.waiting_key(req, now)

    def victim_key(self, req: Any, now: float) -> tuple:
        self._plan.fire("schedule", [req.request_id])
        return self._inner.victim_key(req, now)
