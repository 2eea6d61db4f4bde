"""CPU hogs start with the block and are gone after it, also when the block raises."""

from __future__ import annotations

import pytest

from service.bench.cpu_hog import CpuHog


def test_hogs_run_inside_the_block_and_stop_after() -> None:
    with CpuHog(2) as hog:
        procs = list(hog.procs)
        assert hog.alive() == 2
    assert all(p.poll() is not None for p in procs) and hog.procs == []


def test_hogs_stop_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError):
        with CpuHog(1) as hog:
            procs = list(hog.procs)
            raise RuntimeError("boom")
    assert all(p.poll() is not None for p in procs)


def test_zero_hogs_and_bad_counts() -> None:
    with CpuHog(0) as hog:
        assert hog.alive() == 0
    with pytest.raises(ValueError, match=">= 0"):
        CpuHog(-1)
