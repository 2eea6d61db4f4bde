"""Adaptive CPU thread count: probe one thread fewer or more, keep what is faster.

Why: torch's OpenMP threads meet at a barrier after every parallel op (hundreds a
step). When a busy neighbour takes one of the cores, the thread that shares it runs at
half speed and its sibling spins at every barrier waiting for it, so a step with two
threads became 3x slower than with one (README, CPU threads). No fixed count is right:
one thread wastes an idle machine, two collapse on a busy one. So the step loop measures.

How (pure logic, no torch and no clock of its own: its time is the sum of the step
times it is told, so an idle server, or a benchmark measuring something else between
steps, does not age its timers; tests drive it with made-up step times):

- STEADY at n threads. Each step's wall time is remembered per token-count bucket
  (tokens.bit_length(): 1, 2-3, 4-7, ... tokens) as an exponential moving average.
- A PROBE compares n with a candidate c = n - 1 or n + 1 (within [min, max]) in
  interleaved blocks, n c n c, of `probe_steps` steps each (the first step of each
  block is not counted: the OpenMP team resizes in it). Interleaving cancels the slow
  drift of the batch (contexts grow, requests come and go). A timed probe runs n's block
  first, c n c n's mirror, so that the candidate's steps have a reference even at start-up
  or in a bucket never seen before (a first probe that began with c on 512-token prefill
  steps ran four of them at one thread, each twice as long: 5 s lost in a 27 s
  benchmark); a probe started by a slowdown (below) runs c first, since n is known slow.
- The verdict compares the two arms within each bucket both saw (median step time of c
  over that of n, geometric mean over buckets weighted by samples); c is adopted only
  when it is faster by more than `margin` (hysteresis: a near-tie keeps n).
- Fail fast: a candidate step `abort_slowdown` x slower than n's time for its bucket (its
  median in this probe, else its steady average) ends the probe at once with n kept, so
  probing a count that collapses costs one step, not half the probe.
- When: the first step starts a probe; then each direction has its own timer. A probe
  that keeps n doubles that direction's interval (up to `max_interval_s`), so a machine
  that stays the same is probed less and less, and stretches it further so that the
  time the probe lost (its candidate steps over n's average) is at most `probe_budget`
  of the interval: probing a count that is 10x slower on 0.5 s steps waits 250 s, not
  30. An adoption resets both to `interval_s`. A step slower than `slowdown_trigger` x its bucket's average for
  `trigger_steps` steps in a row (a neighbour arrived) starts a downward probe at once.

Decisions are kept in `history` (time, from, to, ratio) for logs and benchmarks.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TunerSettings:
    """probe_steps: steps per block of a probe (>= 2; the first is not counted).
    blocks: blocks per arm (>= 1). margin: the fraction a candidate must be faster by.
    interval_s / max_interval_s: first and longest wait between probes of a direction.
    slowdown_trigger / trigger_steps: an immediate downward probe after this many steps
    in a row this much slower than their bucket's average. ewma_alpha: weight of a new
    step in that average. probe_budget: the most a failed probe's lost time may be, as a
    fraction of the wait before the next probe in its direction. abort_slowdown: a candidate step this much slower than the
    current count's average ends the probe. Times are seconds of steps (busy time).
    Raises ValueError for out-of-range values."""

    probe_steps: int = 4
    blocks: int = 2
    margin: float = 0.10
    interval_s: float = 2.0
    max_interval_s: float = 30.0
    slowdown_trigger: float = 1.5
    trigger_steps: int = 3
    ewma_alpha: float = 0.2
    abort_slowdown: float = 1.5
    probe_budget: float = 0.02

    def __post_init__(self) -> None:
        for name, ok in (("probe_steps", self.probe_steps >= 2), ("blocks", self.blocks >= 1),
                         ("margin", 0 <= self.margin < 1),
                         ("interval_s", 0 < self.interval_s <= self.max_interval_s),
                         ("slowdown_trigger", self.slowdown_trigger > 1),
                         ("trigger_steps", self.trigger_steps >= 1),
                         ("ewma_alpha", 0 < self.ewma_alpha <= 1),
                         ("abort_slowdown", self.abort_slowdown > 1),
                         ("probe_budget", 0 < self.probe_budget <= 1)):
            if not ok:
                raise ValueError(f"TunerSettings.{name} is out of range: {getattr(self, name)!r}")


def _bucket(tokens: int) -> int:
    return max(1, tokens).bit_length()


@dataclass
class _Probe:
    candidate: int
    plan: list[int]                      # thread count of each probe step, in order
    counted: list[bool]                  # whether that step is measured
    samples: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # threads -> bucket -> s
    step: int = 0
    lost_s: float = 0.0                  # candidate steps' time beyond n's average
    held: bool = False                   # the next step runs at n, off the plan


class ThreadTuner:
    """Chooses the thread count of each step (module docstring).

    Args:
        max_threads: the most threads to use (the pool size); the tuner starts there.
        min_threads: the fewest (default 1).
        settings: probe and hysteresis knobs.

    Use: `n = tuner.threads_for_next_step()`, run the step with n threads, then
    `tuner.observe(seconds, tokens)`. Raises ValueError for max < min or min < 1.
    """

    def __init__(self, max_threads: int, *, min_threads: int = 1,
                 settings: TunerSettings = TunerSettings()) -> None:
        if not 1 <= min_threads <= max_threads:
            raise ValueError(f"need 1 <= min_threads ({min_threads}) <= max_threads ({max_threads})")
        self.min_threads, self.max_threads = min_threads, max_threads
        self.s = settings
        self.busy_s = 0.0  # the tuner's clock: seconds of the steps it was told of
        self.current = max_threads
        self.history: list[tuple[float, int, int, float | None]] = []
        self._baseline: dict[int, float] = {}      # bucket -> EWMA seconds at `current`
        self._seen: dict[int, int] = {}            # bucket -> steps in the baseline
        self._slow_streak = 0
        self._interval = {-1: settings.interval_s, +1: settings.interval_s}
        self._due = {-1: 0.0, +1: 0.0}  # the first step starts a probe: no guess at start
        self._probe: _Probe | None = None

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def threads_for_next_step(self, tokens: int | None = None) -> int:
        """The thread count to run the next step with (may start a due probe). `tokens`:
        the step's token count, when known: a candidate step whose bucket has no time of
        the current count yet (neither in this probe nor steady) runs at the current count
        instead, off the plan, and gives that reference (a probe begun on the decode steps
        of a warm-up request once ran the next 512-token prefill steps at one thread, 2x
        slower, with nothing to abort against)."""
        if self._probe is None:
            self._maybe_start(self.busy_s)
        p = self._probe
        if p is None:
            return self.current
        p.held = (p.plan[p.step] == p.candidate and tokens is not None
                  and self._reference(p, _bucket(tokens)) is None)
        return self.current if p.held else p.plan[p.step]

    def _reference(self, p: _Probe, b: int) -> float | None:
        """The current count's time for bucket b: its median in probe p, else its steady
        average, else None."""
        mine = p.samples.get(self.current, {}).get(b)
        return statistics.median(mine) if mine else self._baseline.get(b)

    def observe(self, seconds: float, tokens: int) -> tuple[float, int, int, float | None] | None:
        """Record the step just run (wall seconds, tokens it processed). A probe that has
        all its steps decides here: returns its `history` entry (time, from, to, ratio;
        from == to when the count stays), else None."""
        if not (seconds > 0 and math.isfinite(seconds)) or tokens < 1:
            return None
        self.busy_s += seconds
        b = _bucket(tokens)
        p = self._probe
        if p is None:
            self._steady(b, seconds)
            return None
        if p.held:  # ran at the current count, off the plan: a reference for its bucket
            p.held = False
            p.samples.setdefault(self.current, {}).setdefault(b, []).append(seconds)
            return None
        threads, counted = p.plan[p.step], p.counted[p.step]
        if counted:
            p.samples.setdefault(threads, {}).setdefault(b, []).append(seconds)
        p.step += 1
        base = self._reference(p, b)
        if threads == p.candidate and base is not None:
            p.lost_s += seconds - base
        if threads == p.candidate and base is not None and seconds > self.s.abort_slowdown * base:
            self._decide(p, aborted=seconds / base)
        elif p.step == len(p.plan):
            self._decide(p)
        else:
            return None
        return self.history[-1]

    def _steady(self, b: int, seconds: float) -> None:
        base = self._baseline.get(b)
        if base is not None and self._seen[b] >= self.s.trigger_steps \
                and seconds > self.s.slowdown_trigger * base:
            self._slow_streak += 1
            if self._slow_streak >= self.s.trigger_steps and self.current > self.min_threads:
                self._slow_streak = 0
                self._start(self.current - 1, candidate_first=True)
                return
        else:
            self._slow_streak = 0
        a = self.s.ewma_alpha
        self._baseline[b] = seconds if base is None else (1 - a) * base + a * seconds
        self._seen[b] = self._seen.get(b, 0) + 1

    def _maybe_start(self, now: float) -> None:
        due = [(t, d) for d, t in self._due.items()
               if t <= now and self.min_threads <= self.current + d <= self.max_threads]
        if due:
            self._start(self.current + min(due)[1])

    def _start(self, candidate: int, candidate_first: bool = False) -> None:
        k = self.s.probe_steps
        plan: list[int] = []
        counted: list[bool] = []
        order = (candidate, self.current) if candidate_first else (self.current, candidate)
        for _ in range(self.s.blocks):
            for n in order:
                plan += [n] * k
                counted += [False] + [True] * (k - 1)
        self._probe = _Probe(candidate, plan, counted)

    def _decide(self, p: _Probe, aborted: float | None = None) -> None:
        """End probe `p`; `aborted`: the ratio of a collapsed candidate step (keep n)."""
        self._probe = None
        now = self.busy_s
        d = +1 if p.candidate > self.current else -1
        ratio = aborted if aborted is not None else self.compare(
            p.samples.get(p.candidate, {}), p.samples.get(self.current, {}))
        if ratio is not None and ratio < 1 - self.s.margin:
            self.history.append((now, self.current, p.candidate, ratio))
            self.current = p.candidate
            self._interval = {-1: self.s.interval_s, +1: self.s.interval_s}
            self._due = {k: now + self.s.interval_s for k in (-1, +1)}
            self._reseed(p.samples.get(p.candidate, {}))
            return
        self.history.append((now, self.current, self.current, ratio))
        if ratio is not None:  # a verdict against the candidate: wait longer next time
            self._interval[d] = max(min(2 * self._interval[d], self.s.max_interval_s),
                                    p.lost_s / self.s.probe_budget)
        self._due[d] = now + self._interval[d]
        if p.samples.get(self.current):  # an aborted probe may have run no step of n
            self._reseed(p.samples[self.current])

    def _reseed(self, samples: dict[int, list[float]]) -> None:
        """The steady baseline after a probe: the kept arm's own step times."""
        self._baseline = {b: statistics.median(v) for b, v in samples.items()}
        self._seen = {b: len(v) for b, v in samples.items()}
        self._slow_streak = 0

    @staticmethod
    def compare(cand: dict[int, list[float]], cur: dict[int, list[float]]) -> float | None:
        """Candidate step time over current's, the geometric mean over common buckets of
        median(cand) / median(cur), weighted by min(samples); None with no common bucket.
        E.g. {1: [0.1, 0.1]} vs {1: [0.2, 0.2, 0.2]} -> 0.5."""
        num = den = 0.0
        for b in cand.keys() & cur.keys():
            w = min(len(cand[b]), len(cur[b]))
            num += w * math.log(statistics.median(cand[b]) / statistics.median(cur[b]))
            den += w
        return math.exp(num / den) if den else None
