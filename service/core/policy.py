"""Scheduling policies: pure orderings the scheduler asks. No I/O, no pool state.

A policy answers:
- `waiting_key(req, now)`: admission order of waiting requests (smallest first);
- `victim_key(req, now)`: which running request to preempt when blocks run short
  (largest first);
- `outranks(waiting, running, now)`: may a waiting request take a running one's
  place when there is no room (priority preemption)? Non-preemptive policies
  answer False;
- `on_finish(req)`: learn from a finished request (SJF's length estimates).

Each class's docstring states its starvation bound; tests/service/test_policies.py
checks each bound on a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.config import PolicyOptions
from service.core.request import Request, RequestStatus


def _new(req: Request) -> bool:
    """Never-run requests sort after preempted ones at equal rank."""
    return req.status is RequestStatus.WAITING


class FCFSPolicy:
    """First come, first served: admit in arrival order; preempt the newest arrival.

    Starvation bound: a request waits only for requests that arrived before it, and
    is never preempted while a newer request runs; preempted requests resume before
    any new one is admitted.
    """

    name = "fcfs"

    def waiting_key(self, req: Request, now: float) -> tuple:
        return (_new(req), req.arrival_time)

    def victim_key(self, req: Request, now: float) -> tuple:
        return (req.arrival_time,)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return False

    def on_finish(self, req: Request) -> None:
        pass


@dataclass
class PriorityPolicy:
    """Lower `params.priority` first (the vLLM convention), ties by arrival, with aging.

    Effective priority = priority - (now - arrival) / aging_s: every `aging_s` seconds
    of age is worth one priority level. A waiting request of higher priority preempts
    the running request of worst effective priority when there is no room.

    Starvation bound: since all requests age at the same rate, a request of priority p
    is outranked only by requests of priority q < p that arrived less than
    (p - q) * aging_s seconds after it (or before it). That set is finite under any
    arrival stream, so the request starts once those are served; no later arrival can
    be admitted before it or preempt it.
    """

    aging_s: float = 10.0
    name: str = "priority"

    def __post_init__(self) -> None:
        if not self.aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0 seconds, got {self.aging_s}")

    def effective(self, req: Request, now: float) -> float:
        return req.params.priority - (now - req.arrival_time) / self.aging_s

    def waiting_key(self, req: Request, now: float) -> tuple:
        return (self.effective(req, now), req.arrival_time)

    def victim_key(self, req: Request, now: float) -> tuple:
        return (self.effective(req, now), req.arrival_time)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return self.waiting_key(waiting, now) < self.victim_key(running, now)

    def on_finish(self, req: Request) -> None:
        pass


@dataclass
class SJFPolicy:
    """Shortest predicted job first (non-preemptive), with aging.

    Predicted job size = tokens still to generate = min(max_tokens, estimate) minus the
    tokens already generated. The estimate is a running mean of the completion lengths
    of finished requests whose prompt falls in the same length bucket (powers of two:
    1, 2-3, 4-7, ... tokens): what is known when a request arrives is its prompt and its
    max_tokens, and in chat traffic prompts of similar length (a short question, a
    pasted document) tend to get answers of similar length; nothing is read from the
    request's future. With no history for a bucket the estimate is max_tokens.

    Aging: the key is size / (1 + wait_s / aging_s). Starvation bound: a waiting job
    of predicted size L overtakes any newcomer of size S >= 1 once it has waited
    aging_s * (L / S - 1) seconds, i.e. at most aging_s * (L - 1).
    """

    aging_s: float = 10.0
    name: str = "sjf"
    _sum: dict[int, float] = field(default_factory=dict)
    _count: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.aging_s > 0:
            raise ValueError(f"sjf_aging_s must be > 0 seconds, got {self.aging_s}")

    @staticmethod
    def bucket(num_prompt_tokens: int) -> int:
        return max(0, num_prompt_tokens).bit_length()

    def predicted_output(self, req: Request) -> float:
        b = self.bucket(req.num_prompt_tokens)
        if self._count.get(b):
            return min(req.params.max_tokens, self._sum[b] / self._count[b])
        return float(req.params.max_tokens)

    def remaining(self, req: Request) -> float:
        return max(1.0, self.predicted_output(req) - len(req.output_token_ids))

    def waiting_key(self, req: Request, now: float) -> tuple:
        age = max(0.0, now - req.arrival_time)
        return (self.remaining(req) / (1.0 + age / self.aging_s), req.arrival_time)

    def victim_key(self, req: Request, now: float) -> tuple:
        return (self.remaining(req), req.arrival_time)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return False

    def on_finish(self, req: Request) -> None:
        if req.finish_reason in ("stop", "length"):
            b = self.bucket(req.num_prompt_tokens)
            self._sum[b] = self._sum.get(b, 0.0) + len(req.output_token_ids)
            self._count[b] = self._count.get(b, 0) + 1


@dataclass
class MLFQPolicy:
    """Multi-level feedback queue with time slices counted in generated tokens.

    New requests enter level 0. A request that has generated `slices[i]` tokens at
    level i sinks to level i + 1 (the last level keeps it). Lower levels are served
    first; a waiting request of a lower level preempts a running one of a higher
    level when there is no room. Every `boost_s` seconds every request is lifted
    back to level 0 (its slice counted afresh), as in Arpaci-Dusseau's OSTEP ch. 8.

    Starvation bound: after the next boost a waiting request is at level 0, where
    order is by arrival; it starts at the latest once the level-0 requests that
    arrived before it have used their first slice, i.e. within boost_s plus
    max_num_seqs * slices[0] steps' worth of work.
    """

    slices: tuple[int, ...] = (8, 16, 32, 64)
    boost_s: float = 5.0
    name: str = "mlfq"
    _last_boost: float | None = None
    _base: dict[str, int] = field(default_factory=dict)   # tokens at the last boost

    def __post_init__(self) -> None:
        if not self.slices or any(s < 1 for s in self.slices):
            raise ValueError(f"mlfq slices must be >= 1 token each, got {self.slices}")
        if not self.boost_s > 0:
            raise ValueError(f"mlfq_boost_s must be > 0 seconds, got {self.boost_s}")

    def _maybe_boost(self, now: float) -> None:
        if self._last_boost is None:
            self._last_boost = now
        elif now - self._last_boost >= self.boost_s:
            self._last_boost = now
            self._base = {}  # every request restarts at level 0

    def level(self, req: Request, now: float) -> int:
        self._maybe_boost(now)
        base = self._base.setdefault(req.request_id, len(req.output_token_ids))
        used = len(req.output_token_ids) - base
        for lvl, s in enumerate(self.slices):
            if used < s:
                return lvl
            used -= s
        return len(self.slices) - 1

    def waiting_key(self, req: Request, now: float) -> tuple:
        return (self.level(req, now), _new(req), req.arrival_time)

    def victim_key(self, req: Request, now: float) -> tuple:
        return (self.level(req, now), req.arrival_time)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return self.level(waiting, now) < self.level(running, now)

    def on_finish(self, req: Request) -> None:
        self._base.pop(req.request_id, None)


@dataclass
class DeadlinePolicy:
    """Least slack first, from `params.ttft_slo_ms` (or `default_ttft_slo_ms`).

    slack = (arrival + ttft_slo) - now - predicted prefill time (prompt tokens /
    prefill_tokens_per_s). Since every waiting request's slack shrinks at the same
    rate, the order is by (deadline - predicted prefill), fixed per request. Requests
    past their deadline are not dropped: their slack is negative and they go first.
    Running requests already have their first token: the newest is the victim.

    Starvation bound: a request is overtaken only by requests whose deadline minus
    prefill is earlier than its own; newcomers arriving later than that moment plus
    the largest SLO can never overtake it.
    """

    default_ttft_slo_ms: float = 2000.0
    prefill_tokens_per_s: float = 500.0
    name: str = "deadline"

    def __post_init__(self) -> None:
        if not self.default_ttft_slo_ms > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError("default_ttft_slo_ms and prefill_tokens_per_s must be > 0")

    def slack_s(self, req: Request, now: float) -> float:
        slo = req.params.ttft_slo_ms or self.default_ttft_slo_ms
        remaining_prefill = max(0, req.num_tokens - req.num_computed_tokens)
        return req.arrival_time + slo / 1000.0 - now - remaining_prefill / self.prefill_tokens_per_s

    def waiting_key(self, req: Request, now: float) -> tuple:
        return (self.slack_s(req, now), req.arrival_time)

    # running requests met their TTFT already: preempt the newest, as FCFS does
    victim_key = FCFSPolicy.victim_key
    outranks = FCFSPolicy.outranks
    on_finish = FCFSPolicy.on_finish


Policy = FCFSPolicy | PriorityPolicy | SJFPolicy | MLFQPolicy | DeadlinePolicy
POLICIES = ("fcfs", "priority", "sjf", "mlfq", "deadline")


def make_policy(name: str, options: PolicyOptions | None = None,
                prefill_tokens_per_s: float | None = None) -> Policy:
    """A policy by name; raises ValueError for an unknown one or bad options."""
    o = options or PolicyOptions()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(aging_s=o.priority_aging_s)
    if name == "sjf":
        return SJFPolicy(aging_s=o.priority_aging_s)
    if name == "mlfq":
        return MLFQPolicy(slices=tuple(o.mlfq_slices), boost_s=o.mlfq_boost_s)
    if name == "deadline":
        return DeadlinePolicy(default_ttft_slo_ms=o.default_ttft_slo_ms,
                              prefill_tokens_per_s=prefill_tokens_per_s or 500.0)
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")
