"""The fake-runner scheduler overhead measurement (issue 9, item 4) runs the real
scheduler to steady decoding and reports consistent figures. No timing is asserted:
the figures themselves come from `python -m service.bench.scheduler_overhead`."""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from service.bench.scheduler_overhead import REFERENCE_STEP_MS, main, measure
from service.core.null_runner import NullRunner
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput


def _seq(rid: str, sample: bool) -> ScheduledSequence:
    return ScheduledSequence(rid, [1], 4, [0], sample, SamplingParams())


def test_null_runner_samples_one_token_per_sampling_sequence() -> None:
    runner = NullRunner(token_fn=lambda rid, pos: 7 + pos)
    out = SchedulerOutput([_seq("a", True), _seq("b", False), _seq("c", True)], 3)
    assert runner.execute(out).sampled == {"a": 7, "c": 7}
    assert runner.execute(out).sampled == {"a": 8, "c": 8}
    assert (runner.steps, runner.tokens) == (2, 6)
    runner.execute(SchedulerOutput([], 0, finished_request_ids=("a",)))
    assert runner.forgotten == ["a"] and runner.steps == 2


def test_measure_runs_every_sequence_every_step_and_adds_up() -> None:
    # measure() raises if a measured step did not run all 48 sequences, and checks the
    # pool's integrity at the end
    r = measure(48, 40, 4, block_size=8, warmup=2)
    assert r["num_seqs"] == 48 and r["context"] == 40
    assert r["schedule_ms"] > 0 and r["update_ms"] > 0
    assert r["total_ms"] == pytest.approx(r["schedule_ms"] + r["update_ms"])
    assert r["percent_of_15ms"] == pytest.approx(100 * r["total_ms"] / REFERENCE_STEP_MS)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_seqs"):
        measure(0, 10, 1)
    assert main(["--num-seqs", "x"]) == 2


def test_main_prints_a_row_per_count(capsys) -> None:
    assert main(["--num-seqs", "4,8", "--context", "20", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "seqs"
    assert [line.split()[0] for line in lines[1:]] == ["4", "8"]
