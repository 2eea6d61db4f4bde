"""The bandwidth bound's arithmetic and its read measurement (service/bench/bandwidth.py);
the weight bytes of real runners are checked in tests/integration/test_engine_only_bench.py."""

from __future__ import annotations

import pytest

from service.bench.bandwidth import bound_fraction, read_bandwidth


def test_bound_fraction_is_bound_time_over_step_time() -> None:
    # 96.4 MB at 30 GB/s is 3.213 ms; a 5 ms step reaches 64% of that bound
    assert bound_fraction(5.0, 96_400_000, 30.0) == pytest.approx(3.21333 / 5.0, rel=1e-5)
    assert bound_fraction(3.21333, 96_400_000, 30.0) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("args", [(0.0, 1, 1.0), (1.0, 0, 1.0), (1.0, 1, 0.0), (-1.0, 1, 1.0)])
def test_bound_fraction_refuses_non_positive_inputs(args) -> None:
    with pytest.raises(ValueError, match="positive"):
        bound_fraction(*args)


def test_read_bandwidth_is_a_positive_rate() -> None:
    assert read_bandwidth(mib=8, repeats=2).best_gb_s > 0
    bw = read_bandwidth(mib=8, repeats=3)
    assert bw.best_gb_s >= bw.median_gb_s > 0  # the best of 3 is never below their median
    with pytest.raises(ValueError, match="positive"):
        read_bandwidth(mib=8, repeats=0)
