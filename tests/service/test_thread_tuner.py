"""The adaptive thread tuner, pure: made-up step times are its (fake) clock."""

from __future__ import annotations

import random

import pytest

from service.worker.thread_tuner import ThreadTuner, TunerSettings


def run_steps(tuner: ThreadTuner, step_s, n: int, tokens: int = 1) -> list[int]:
    """Run n steps whose time is step_s(threads, busy seconds so far); returns the thread
    count of each."""
    used = []
    for _ in range(n):
        threads = tuner.threads_for_next_step()
        tuner.observe(step_s(threads, tuner.busy_s), tokens)
        used.append(threads)
    return used


def test_compare_by_hand() -> None:
    assert ThreadTuner.compare({1: [0.1, 0.1]}, {1: [0.2, 0.2, 0.2]}) == pytest.approx(0.5)
    # buckets weigh by min(samples): (2 x log 0.5 + 1 x log 2) / 3
    r = ThreadTuner.compare({1: [1.0, 1.0], 5: [4.0]}, {1: [2.0, 2.0], 5: [2.0, 2.0]})
    assert r == pytest.approx(0.5 ** (1 / 3))
    assert ThreadTuner.compare({1: [1.0]}, {5: [1.0]}) is None


def test_settings_are_checked() -> None:
    for bad in ({"probe_steps": 1}, {"blocks": 0}, {"margin": 1.0}, {"interval_s": 0},
                {"interval_s": 5, "max_interval_s": 4}, {"slowdown_trigger": 1.0},
                {"trigger_steps": 0}, {"ewma_alpha": 0}, {"abort_slowdown": 1.0}):
        with pytest.raises(ValueError, match="TunerSettings"):
            TunerSettings(**bad)
    with pytest.raises(ValueError):
        ThreadTuner(2, min_threads=3)


def test_a_probe_interleaves_blocks_and_adopts_a_faster_candidate() -> None:
    tuner = ThreadTuner(2)
    # a busy neighbour: 2 threads take 150 ms a step, 1 thread 50 ms
    used = run_steps(tuner, lambda n, t: 0.150 if n == 2 else 0.050, 16)
    assert used == [2] * 4 + [1] * 4 + [2] * 4 + [1] * 4  # n c n c, starting at once
    assert tuner.current == 1 and not tuner.probing
    (when, was, now, ratio), = tuner.history
    assert tuner.observe(0.05, 1) is None  # steady steps decide nothing
    assert (was, now) == (2, 1) and ratio == pytest.approx(1 / 3)
    assert run_steps(tuner, lambda n, t: 0.05, 5) == [1] * 5  # steady until due


def test_a_near_tie_keeps_the_count_and_backs_off() -> None:
    s = TunerSettings(interval_s=2.0, max_interval_s=8.0)
    tuner = ThreadTuner(2, settings=s)
    step = lambda n, t: 0.100 if n == 2 else 0.095   # 1 thread only 5% faster: < margin
    probes_at = []
    for _ in range(400):
        probing = tuner.probing
        tuner.threads_for_next_step()  # starts a due probe
        if tuner.probing and not probing:
            probes_at.append(round(tuner.busy_s, 1))
        run_steps(tuner, step, 1)
    assert tuner.current == 2 and all(was == now for _, was, now, _ in tuner.history)
    gaps = [b - a for a, b in zip(probes_at, probes_at[1:])]
    # each failed probe doubles the wait, 2 -> 4 -> 8 s (the cap), counted from the end
    # of the probe (16 steps, 1.6 s)
    assert gaps[0] == pytest.approx(4.0 + 1.6, abs=0.2)
    assert gaps[1:] == pytest.approx([8.0 + 1.6] * len(gaps[1:]), abs=0.2) and len(gaps) > 3


def test_no_common_bucket_is_no_verdict() -> None:
    tuner = ThreadTuner(2)
    for i in range(16):
        threads = tuner.threads_for_next_step()
        tuner.observe(0.1 if threads == 1 else 0.3, 1 if threads == 1 else 64)
    assert tuner.current == 2 and tuner.history[-1][3] is None


def test_a_sudden_slowdown_starts_a_downward_probe_at_once() -> None:
    tuner = ThreadTuner(2, settings=TunerSettings(interval_s=30, max_interval_s=30))
    run_steps(tuner, lambda n, t: 0.050 if n == 2 else 0.080, 16)  # first probe: keep 2
    assert tuner.current == 2 and not tuner.probing
    run_steps(tuner, lambda n, t: 0.05, 10)
    assert not tuner.probing  # 30 s until the next timed probe
    run_steps(tuner, lambda n, t: 0.150 if n == 2 else 0.050, 3)  # a neighbour arrives
    assert tuner.probing and tuner.threads_for_next_step() == 1
    run_steps(tuner, lambda n, t: 0.150 if n == 2 else 0.050, 16)
    assert tuner.current == 1


def test_one_thread_never_probes() -> None:
    tuner = ThreadTuner(1)
    assert run_steps(tuner, lambda n, t: 0.05, 50) == [1] * 50 and not tuner.history


def test_invalid_observations_are_ignored() -> None:
    tuner = ThreadTuner(2)
    tuner.threads_for_next_step()
    for seconds, tokens in ((0.0, 1), (float("nan"), 1), (0.1, 0)):
        tuner.observe(seconds, tokens)
    assert tuner.probing and not tuner.history


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_neighbour_that_comes_and_goes_costs_under_ten_percent(seed) -> None:
    """200 s of decode steps; a busy neighbour from 40 s to 120 s. Idle: 2 threads 50 ms,
    1 thread 75 ms; busy: 2 threads 160 ms, 1 thread 80 ms (the README's collapse);
    +-10% noise. The tuner must do >= 90% of the steps the best count would."""
    rng = random.Random(seed)

    def step(n: int, t: float) -> float:
        busy = 40.0 <= t < 120.0
        base = {(False, 2): 0.050, (False, 1): 0.075, (True, 2): 0.160, (True, 1): 0.080}
        return base[(busy, n)] * rng.uniform(0.9, 1.1)

    tuner = ThreadTuner(2)
    steps = 0
    while tuner.busy_s < 200.0:
        run_steps(tuner, step, 1, tokens=16)
        steps += 1
    best = 40.0 / 0.050 + 80.0 / 0.080 + 80.0 / 0.050   # the oracle's steps in 200 s
    assert steps >= 0.90 * best
    assert [(was, now) for _, was, now, _ in tuner.history if was != now] == [(2, 1), (1, 2)]


def test_a_collapsing_candidate_ends_its_probe_after_one_step() -> None:
    tuner = ThreadTuner(2)
    busy = lambda n, t: 0.150 if n == 2 else 0.050
    run_steps(tuner, busy, 16)                      # first probe: down to 1 thread
    assert tuner.current == 1
    used = run_steps(tuner, busy, 60)               # 2 s later an upward probe is due
    first_up = used.index(2)
    assert used[first_up:first_up + 2] == [2, 1]    # one step at 2 threads, then back
    _, was, now, ratio = tuner.history[-1]
    assert (was, now) == (1, 1) and ratio == pytest.approx(3.0)
    assert used.count(2) == 1                       # next upward probe 4 s later: not yet


def test_a_costly_failed_probe_waits_long_enough_to_stay_within_its_budget() -> None:
    """A 10x collapse on 0.5 s steps: the aborted probe lost 4.5 s, so with a 2% budget the
    next upward probe waits 225 s of steps, beyond the 30 s doubling cap."""
    tuner = ThreadTuner(2)
    busy = lambda n, t: 5.0 if n == 2 else 0.5
    run_steps(tuner, busy, 16)                      # start-up probe: down to 1 thread
    used = run_steps(tuner, busy, 700)              # 350 s of steps
    ups = [i for i, n in enumerate(used) if n == 2]
    assert len(ups) == 2                            # after 2 s, then 225 s later
    # (plus the probe's first block, 4 steps at 1 thread, before its step at 2)
    assert (ups[1] - ups[0]) * 0.5 == pytest.approx(4.5 / 0.02 + 4 * 0.5, abs=1.0)


def test_the_start_up_probe_on_long_prefill_steps_costs_one_step() -> None:
    """The first probe starts at the first step, with no steady average yet: on 512-token
    steps where one thread is twice as slow, it runs n's block first and aborts at the
    candidate's first step (it once ran four such steps at one thread: 5 s lost)."""
    tuner = ThreadTuner(2)
    used = run_steps(tuner, lambda n, t: 1.25 if n == 2 else 2.5, 12, tokens=512)
    assert used[:6] == [2, 2, 2, 2, 1, 2] and used[5:] == [2] * 7
    _, was, now, ratio = tuner.history[-1]
    assert (was, now) == (2, 2) and ratio == pytest.approx(2.0)


def test_a_candidate_step_in_a_bucket_without_a_reference_runs_at_the_current_count() -> None:
    """A probe begun on a warm-up request's one-token decode steps reaches its candidate
    block as 512-token prefill steps start: told the next step's tokens, the tuner runs
    the first such step at the current count (a reference, off the plan), then the
    candidate, which aborts at once when it is 2x slower. Unaware of the tokens it would run
    prefill at one thread with nothing to compare against."""
    # decodes take as long at one thread (memory-bound); prefill twice as long
    step = lambda n, tokens: 0.015 if tokens == 1 else (1.25 if n == 2 else 2.5)
    tuner = ThreadTuner(2)
    used = []
    for tokens in [1] * 5 + [512] * 8:
        n = tuner.threads_for_next_step(tokens)
        tuner.observe(step(n, tokens), tokens)
        used.append(n)
    assert used[:5] == [2, 2, 2, 2, 1]          # n's block, then the candidate's, on decodes
    assert used[5:8] == [2, 1, 2]               # held at 2 (a reference), 1, aborted: back to 2
    assert used[8:] == [2] * 5 and tuner.current == 2
    _, was, now, ratio = tuner.history[-1]
    assert (was, now) == (2, 2) and ratio == pytest.approx(2.0)
