"""After a step fails half way: blame the requests that cause it, make the others safe.

EngineCore calls these when `Scheduler.schedule()` raises (see its docstring). A failed
schedule() may have preempted, swapped or allocated for some requests without their
block copies ever running; the safe state for every survivor is "preempted, to be
recomputed from its tokens" (nothing already sent changes), except swapped-out requests
whose copies did run in an earlier step.
"""

from __future__ import annotations

from service.core.request import RequestStatus
from service.core.scheduler import Scheduler

__all__ = ["faulty_requests", "reset_after_fault"]


def faulty_requests(sched: Scheduler, now: float) -> dict[str, str]:
    """Requests whose own data makes the policy fail (e.g. arithmetic on a field):
    request id -> why. Pins a schedule() failure on its cause."""
    bad: dict[str, str] = {}
    for req in sched.waiting + sched.running:
        try:
            sched.policy.waiting_key(req, now)
            sched.policy.victim_key(req, now)
        except Exception as e:  # noqa: BLE001
            bad[req.request_id] = f"{type(e).__name__}: {e}"
    return bad


def reset_after_fault(sched: Scheduler) -> list[str]:
    """Make every unfinished request safe to schedule again: the running ones, and any
    that took blocks or were swapped out in the failed call, drop their blocks and will
    be recomputed. Returns the ids reset."""
    ops = sched.ops_in_progress
    lost_cpu = {cpu for _, cpu in ops.swap_out} if ops is not None else set()
    sched.forget_step()
    reset = []
    for req in list(sched.running):
        sched.running.remove(req)
        sched.waiting.append(req)
        reset.append(req.request_id)
        sched.kv.free(req)
        req.status = RequestStatus.PREEMPTED
    for req in sched.waiting:
        # blocks taken for a start or swap-in whose copies never ran, or a swap-out
        # whose copy never ran: their K/V is lost, so recompute
        lost = req.status is RequestStatus.SWAPPED and \
            bool(lost_cpu.intersection(req.cpu_block_ids))
        if req.block_ids or lost:
            sched.kv.free(req)
            if req.status is not RequestStatus.WAITING:
                req.status = RequestStatus.PREEMPTED
            if req.request_id not in reset:
                reset.append(req.request_id)
        if req.status is not RequestStatus.SWAPPED:
            req.num_computed_tokens = 0
            req.num_registered_blocks = 0
    sched.batching.batch &= set(sched.requests)
    return reset
