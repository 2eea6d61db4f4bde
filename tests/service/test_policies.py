"""Scheduling policies and batching modes on hand-made arrival traces (EngineCore with a
NullRunner, fake clock).

Each trace records, step by step, which requests were scheduled, preempted and finished,
and the tests assert the exact order. Starvation bounds are checked against each policy's
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from protocol import SamplingParams
from service.core.config import CacheConfig, EngineConfig, PolicyOptions, SchedulerConfig
from service.core.engine_core import EngineCore
from service.core.null_runner import NullRunner
from service.core.policy import SJFPolicy, make_policy
from service.core.request import Request
from service.core.scheduler import Scheduler

STEP_S = 0.1  # fake seconds per step


@dataclass
class Trace:
    """Drives an EngineCore with a NullRunner and a fake clock; arrivals are (time, request)."""

    core: EngineCore
    runner: NullRunner
    clock: list[float]
    arrivals: list[tuple[float, Request]] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (step, kind, id)
    finish_step: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    step_no: int = 0

    @property
    def sched(self) -> Scheduler:
        return self.core.scheduler

    def run(self, max_steps: int = 10_000) -> None:
        # list order breaks ties between equal arrival times (1 us apart)
        pending = sorted(((t + 1e-6 * i, r) for i, (t, r) in enumerate(self.arrivals)),
                         key=lambda a: a[0])
        while (pending or self.core.has_unfinished()) and self.step_no < max_steps:
            while pending and pending[0][0] <= self.clock[0] + 1e-3:
                t, req = pending.pop(0)
                req.arrival_time = t
                self.core.add_request(req)
            calls_before = len(self.runner.calls)
            finished = [o.request_id for o in self.core.step() if o.finish_reason is not None]
            scheduled = self.runner.calls[-1] if len(self.runner.calls) > calls_before else []
            started = [rid for rid in scheduled if rid not in self.first_step]
            for kind, ids in (("preempt", self.core.last_preempted), ("start", started),
                              ("finish", finished)):
                self.events += [(self.step_no, kind, rid) for rid in ids]
            for rid in started:
                self.first_step[rid] = self.step_no
            for rid in finished:
                self.finish_step[rid] = self.step_no
            self.core.check_integrity()
            self.step_no += 1
            self.clock[0] = self.step_no * STEP_S  # no float drift over many steps

    def order(self, kind: str) -> list[str]:
        return [rid for _, k, rid in self.events if k == kind]


def trace(policy: str = "fcfs", *, max_num_seqs: int = 2, budget: int = 64, blocks: int = 64,
          batching: str = "continuous", interval: int = 1, delay_ms: float = 50.0,
          options: PolicyOptions | None = None) -> Trace:
    clock = [0.0]
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          preemption_mode="recompute", scheduling_policy=policy,
                          policy=options or PolicyOptions(), batching=batching,
                          schedule_interval=interval, max_queue_delay_ms=delay_ms)
    cache = CacheConfig(block_size=4, enable_prefix_caching=False, kv_watermark_low=1.0,
                        kv_watermark_high=1.0, kv_watermark_critical=1.0)
    runner = NullRunner(blocks, max_model_len=10_000, token_fn=lambda rid, pos: 5)
    core = EngineCore(EngineConfig(cache=cache, scheduler=cfg), runner, clock=lambda: clock[0])
    return Trace(core, runner, clock)


def R(rid: str, *, tokens: int = 4, prompt: int = 4, priority: int = 0,
      slo: float | None = None) -> Request:
    return Request(rid, list(range(1, prompt + 1)),
                   SamplingParams(max_tokens=tokens, priority=priority, ttft_slo_ms=slo,
                                  ignore_eos=True))


# ---- FCFS --------------------------------------------------------------------------------

def test_fcfs_starts_in_arrival_order():
    t = trace("fcfs", max_num_seqs=2)
    t.arrivals = [(0.0, R("a", tokens=3)), (0.0, R("b", tokens=6)), (0.05, R("c", tokens=2))]
    t.run()
    assert t.events == [(0, "start", "a"), (0, "start", "b"), (2, "finish", "a"),
                        (3, "start", "c"), (4, "finish", "c"), (5, "finish", "b")]


# ---- priority ------------------------------------------------------------------------------

def test_priority_high_request_preempts_a_low_one_and_finishes_first():
    t = trace("priority", max_num_seqs=2)
    t.arrivals = [(0.0, R(f"low{i}", tokens=20, priority=5)) for i in range(4)]
    t.arrivals.append((0.35, R("high", tokens=3, priority=0)))
    t.run()
    # low0 and low1 run; at step 4 high arrives, finds no room and preempts the
    # newest low-priority runner (low1), which resumes before low2 and low3
    assert t.events[:4] == [(0, "start", "low0"), (0, "start", "low1"),
                            (4, "preempt", "low1"), (4, "start", "high")]
    assert t.order("finish")[0] == "high"
    assert t.order("finish") == ["high", "low0", "low1", "low2", "low3"]


def test_priority_aging_bounds_the_wait_of_a_low_priority_request():
    aging = 1.0
    t = trace("priority", max_num_seqs=1, options=PolicyOptions(priority_aging_s=aging))
    t.arrivals = [(0.0, R("high-first", tokens=3, priority=0)),
                  (0.05, R("low", tokens=3, priority=5))]
    # a steady stream of high-priority requests, one every 0.2 s for 20 s
    t.arrivals += [(0.1 + 0.2 * i, R(f"h{i}", tokens=3, priority=0)) for i in range(100)]
    t.run()
    # the docstring's bound: only requests of priority 0 that arrived less than
    # (5 - 0) * aging_s after it may start before it; every later one starts after it
    arrival = dict((r.request_id, a) for a, r in t.arrivals)
    low_start = t.first_step["low"]
    before = [rid for rid, step in t.first_step.items() if step < low_start]
    assert all(arrival[rid] < 0.05 + 5 * aging for rid in before)
    later = [rid for rid, a in arrival.items() if a > 0.05 + 5 * aging]
    assert later and all(t.first_step[rid] > low_start for rid in later)
    assert low_start * STEP_S > 2.0  # it did wait: the high stream went first for a while


# ---- SJF -------------------------------------------------------------------------------------

def test_sjf_orders_by_predicted_length_from_max_tokens_then_history():
    t = trace("sjf", max_num_seqs=1)
    # "first" has a prompt of another length bucket: its length teaches nothing here
    t.arrivals = [(0.0, R("first", tokens=2, prompt=40)), (0.01, R("long", tokens=30, prompt=4)),
                  (0.02, R("short", tokens=5, prompt=8)), (0.03, R("mid", tokens=12, prompt=16))]
    t.run()
    assert t.order("start") == ["first", "short", "mid", "long"]


def test_sjf_estimate_uses_finished_lengths_of_the_same_prompt_bucket():
    policy = make_policy("sjf")
    assert isinstance(policy, SJFPolicy)
    done = R("done", tokens=100, prompt=40)
    done.output_token_ids = [1] * 12
    done.finish_reason = "stop"
    policy.on_finish(done)
    same_bucket, other_bucket = R("x", tokens=100, prompt=50), R("y", tokens=100, prompt=5)
    assert policy.predicted_output(same_bucket) == 12      # 40 and 50 tokens: bucket 6
    assert policy.predicted_output(other_bucket) == 100    # no history: max_tokens
    cancelled = R("c", tokens=100, prompt=40)
    cancelled.finish_reason = "cancelled"
    policy.on_finish(cancelled)                            # cancels teach nothing
    assert policy.predicted_output(same_bucket) == 12


def test_sjf_aging_bounds_the_wait_of_a_long_job():
    aging = 0.5
    t = trace("sjf", max_num_seqs=1, options=PolicyOptions(priority_aging_s=aging))
    t.arrivals = [(0.0, R("busy", tokens=2, prompt=40)), (0.01, R("long", tokens=40))]
    t.arrivals += [(0.02 + 0.2 * i, R(f"s{i}", tokens=2)) for i in range(200)]
    t.run()
    # bound: aging_s * (L / S - 1) seconds, then it waits at most for the runner (2 steps)
    bound = 0.01 + aging * (40 / 2 - 1) + 2 * STEP_S
    assert t.first_step["long"] * STEP_S <= bound + 1e-9
    assert t.first_step["long"] > t.first_step["s0"]


# ---- MLFQ --------------------------------------------------------------------------------------

def test_mlfq_long_job_sinks_and_a_new_one_preempts_it():
    t = trace("mlfq", max_num_seqs=1,
              options=PolicyOptions(mlfq_slices=(2, 4, 8), mlfq_boost_s=100.0))
    t.arrivals = [(0.0, R("long", tokens=12)), (0.45, R("new", tokens=2))]
    t.run()
    # long used its 2-token slice at level 0 and 4 more at level 1 by step 5 -> level 2
    assert t.events[:3] == [(0, "start", "long"), (5, "preempt", "long"), (5, "start", "new")]
    assert t.order("finish") == ["new", "long"]


def test_mlfq_boost_lifts_a_sunk_job_above_a_stream_of_newcomers():
    boost = 2.0
    t = trace("mlfq", max_num_seqs=1,
              options=PolicyOptions(mlfq_slices=(2, 4), mlfq_boost_s=boost))
    t.arrivals = [(0.0, R("long", tokens=30))]
    # newcomers keep coming, each needs more than one slice so it sinks too
    t.arrivals += [(0.3 + 0.4 * i, R(f"n{i}", tokens=3)) for i in range(40)]
    t.run()
    assert t.finish_step["long"] * STEP_S < 0.3 + 0.4 * 40  # finishes before the stream ends
    assert len(t.order("preempt")) > 0


# ---- deadline -------------------------------------------------------------------------------------

def test_deadline_least_slack_first_and_late_requests_are_not_dropped():
    t = trace("deadline", max_num_seqs=1,
              options=PolicyOptions(default_ttft_slo_ms=10_000))
    t.arrivals = [(0.0, R("busy", tokens=10)),
                  (0.01, R("relaxed", tokens=2, slo=5_000)),
                  (0.02, R("default", tokens=2)),            # 10 s
                  (0.03, R("urgent", tokens=2, slo=100))]    # past its deadline when it starts
    t.run()
    assert t.order("start") == ["busy", "urgent", "relaxed", "default"]
    assert set(t.order("finish")) == {"busy", "urgent", "relaxed", "default"}


# ---- batching modes -------------------------------------------------------------------------------

def test_static_batch_runs_to_completion_before_the_next_starts():
    t = trace("fcfs", max_num_seqs=2, batching="static")
    t.arrivals = [(0.0, R("a", tokens=2)), (0.0, R("b", tokens=6)), (0.0, R("c", tokens=2))]
    t.run()
    # c waits for the whole batch {a, b}, although a's slot was free from step 2, and
    # a's end (its done) is held until the batch ends with b
    assert t.events == [(0, "start", "a"), (0, "start", "b"), (5, "finish", "b"),
                        (5, "finish", "a"), (6, "start", "c"), (7, "finish", "c")]
    assert t.sched.requests == {} and not t.core.has_unfinished()


def test_dynamic_batch_waits_for_a_full_batch_or_the_queue_delay():
    t = trace("fcfs", max_num_seqs=3, batching="dynamic", delay_ms=250.0)
    t.arrivals = [(0.0, R("a", tokens=2)), (0.1, R("b", tokens=2)), (1.0, R("c", tokens=2)),
                  (1.0, R("d", tokens=2)), (1.0, R("e", tokens=2))]
    t.run()
    # a's batch starts 250 ms after a arrived (step 3: t = 0.3 s) with a and b;
    # c, d, e fill a batch at once when they arrive (step 10: t = 1.0 s)
    assert t.events[:2] == [(3, "start", "a"), (3, "start", "b")]
    assert [e for e in t.events if e[1] == "start"][2:] == [(10, "start", "c"), (10, "start", "d"),
                                                            (10, "start", "e")]


def test_continuous_schedule_interval_admits_every_n_steps():
    t = trace("fcfs", max_num_seqs=4, interval=3)
    t.arrivals = [(0.0, R("a", tokens=8)), (0.05, R("b", tokens=2)), (0.35, R("c", tokens=2))]
    t.run()
    # admission happens at steps 0, 3, 6, ... while something runs
    assert [e for e in t.events if e[1] == "start"] == [(0, "start", "a"), (3, "start", "b"),
                                                        (6, "start", "c")]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "mlfq", "deadline"])
def test_every_policy_finishes_everything_under_pressure(policy):
    # a tiny pool (forces recompute preemption) and a mixed stream: nothing is lost
    t = trace(policy, max_num_seqs=3, blocks=10, budget=16,
              options=PolicyOptions(mlfq_slices=(2, 4), mlfq_boost_s=1.0))
    t.arrivals = [(0.1 * i, R(f"r{i}", tokens=3 + (i * 7) % 13, prompt=3 + i % 5,
                                priority=i % 3)) for i in range(30)]
    t.run()
    assert sorted(t.finish_step) == sorted(f"r{i}" for i in range(30))
    assert not t.sched.has_unfinished() and t.sched.pool.usage == 0
