"""Statistics, metrics and arrivals against hand-computed values."""

from __future__ import annotations

import math
import statistics

import pytest

from service.bench.arrivals import arrival_times
from service.bench.metrics import Slo, compute_metrics
from service.bench.record import RequestRecord
from service.bench.stats import Summary, percentile


def test_percentile_by_hand():
    xs = [4.0, 1.0, 3.0, 2.0]                      # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)   # h = 1.5
    assert percentile(xs, 90) == pytest.approx(3.7)   # h = 2.7: 3 + 0.7 * 1
    assert percentile(xs, 99) == pytest.approx(3.97)  # h = 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)


def test_percentile_errors():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)


def test_summary():
    s = Summary.of([50.0, 200.0, 100.0])
    assert s.count == 3
    assert s.mean == pytest.approx(350 / 3)
    assert s.median == 100.0
    assert s.p90 == pytest.approx(180.0)              # h = 1.8: 100 + 0.8 * 100
    assert s.p99 == pytest.approx(198.0)
    assert s.max == 200.0
    assert Summary.of([]) == Summary(0, None, None, None, None, None)


def _records() -> list[RequestRecord]:
    a = RequestRecord(index=0, request_id="b0", input_tokens=10, max_tokens=3, scheduled_s=0.0,
                      sent_s=0.0, done_s=0.5, delta_times_s=[0.1, 0.2, 0.4],
                      delta_token_counts=[1, 1, 1], engine_ttft_ms=90.0, engine_queue_ms=5.0,
                      cached_tokens=4)
    b = RequestRecord(index=1, request_id="b1", input_tokens=20, max_tokens=3, scheduled_s=0.1,
                      sent_s=0.1, done_s=0.4, delta_times_s=[0.3, 0.35],
                      delta_token_counts=[1, 2], engine_ttft_ms=195.0, engine_queue_ms=20.0)
    c = RequestRecord(index=2, request_id="b2", input_tokens=30, max_tokens=3, scheduled_s=0.1,
                      sent_s=0.1, error="overloaded: queue full")
    return [a, b, c]


def test_record_latencies_by_hand():
    a, b, c = _records()
    assert a.ttft_ms == pytest.approx(100.0)
    assert a.tpot_ms == pytest.approx(150.0)          # (0.4 - 0.1) / (3 - 1)
    assert a.itl_ms == pytest.approx([100.0, 200.0])
    assert a.e2e_ms == pytest.approx(500.0)
    assert a.ttft_gap_ms == pytest.approx(10.0)
    assert b.output_tokens == 3                        # the merged delta counts its 2 tokens
    assert b.ttft_ms == pytest.approx(200.0)
    assert b.tpot_ms == pytest.approx(25.0)           # (0.35 - 0.3) / 2
    assert b.itl_ms == pytest.approx([50.0])          # one gap between two frames
    assert not c.ok and c.ttft_ms is None and c.tpot_ms is None and c.e2e_ms is None


def test_metrics_by_hand():
    m = compute_metrics(_records(), Slo(ttft_ms=150.0))
    assert (m.num_requests, m.completed, m.failed) == (3, 2, 1)
    assert m.duration_s == pytest.approx(0.5)         # t = 0 to the last done
    assert m.output_tokens == 6 and m.input_tokens == 30 and m.cached_tokens == 4
    assert m.requests_per_s == pytest.approx(4.0)
    assert m.output_tokens_per_s == pytest.approx(12.0)
    assert m.goodput_requests_per_s == pytest.approx(2.0)  # only b0 has TTFT <= 150 ms
    assert m.goodput_output_tokens_per_s == pytest.approx(6.0)  # b0's 3 tokens / 0.5 s
    assert m.slo_attainment == pytest.approx(1 / 3)
    assert m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.p90 == pytest.approx(190.0)
    assert m.itl_ms.count == 3 and m.itl_ms.median == pytest.approx(100.0)
    assert m.e2e_ms.max == pytest.approx(500.0)
    assert m.short_e2e_ms.count == 2                  # every max_tokens is the median
    assert m.engine_queue_ms.mean == pytest.approx(12.5)
    assert m.ttft_gap_ms.mean == pytest.approx(7.5)   # (10 + 5) / 2
    no_slo = compute_metrics(_records())
    assert no_slo.goodput_requests_per_s is None and no_slo.slo_attainment is None
    assert no_slo.goodput_output_tokens_per_s is None


def test_short_e2e_is_the_requests_at_or_under_the_median_max_tokens():
    # seed-exercise's shape: 8 short requests and 2 long ones
    recs = [RequestRecord(index=i, request_id=f"s{i}", input_tokens=5,
                          max_tokens=1000 if i % 5 == 4 else 100, scheduled_s=0.0, sent_s=0.0,
                          done_s=(10.0 if i % 5 == 4 else 1.0 + i / 10),
                          delta_times_s=[0.5], delta_token_counts=[1]) for i in range(10)]
    m = compute_metrics(recs)
    assert m.short_e2e_ms.count == 8
    shorts = [1000.0 * (1.0 + i / 10) for i in range(10) if i % 5 != 4]
    assert m.short_e2e_ms.mean == pytest.approx(sum(shorts) / 8)
    assert m.e2e_ms.max == pytest.approx(10_000.0)


def test_slo_tpot_bound_and_single_token():
    a, b, _ = _records()
    assert Slo(tpot_ms=100.0).met_by(b) and not Slo(tpot_ms=100.0).met_by(a)
    one = RequestRecord(index=3, request_id="b3", input_tokens=1, max_tokens=1, scheduled_s=0,
                        sent_s=0, done_s=0.2, delta_times_s=[0.1], delta_token_counts=[1])
    assert one.tpot_ms is None and Slo(tpot_ms=1.0).met_by(one)
    assert Slo(e2e_ms=400.0).met_by(b) and not Slo(e2e_ms=400.0).met_by(a)


def test_slo_parse():
    assert Slo.parse("ttft=500,tpot=50") == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert Slo.parse(" e2e=2000 ") == Slo(e2e_ms=2000.0)
    for bad, msg in (("ttft", "KEY=MS"), ("itl=5", "KEY=MS"), ("ttft=0", "> 0"),
                     ("ttft=abc", "not a number"), ("ttft=1,ttft=2", "twice")):
        with pytest.raises(ValueError, match=msg):
            Slo.parse(bad)


def test_metrics_need_records():
    with pytest.raises(ValueError):
        compute_metrics([])


def test_arrivals_all_at_once_and_deterministic():
    assert arrival_times(3) == [0.0, 0.0, 0.0]
    assert arrival_times(0, 2.0) == []
    a = arrival_times(50, 4.0, 1.0, seed=1)
    assert a == arrival_times(50, 4.0, 1.0, seed=1) and a != arrival_times(50, 4.0, 1.0, seed=2)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))


def test_arrival_gaps_have_the_asked_mean_and_shape():
    n = 4000
    poisson = arrival_times(n, 2.0, 1.0, seed=0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = arrival_times(n, 2.0, 0.25, seed=0)       # gamma shape 1/4: CV = 1/sqrt(1/4) = 2
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.15)


def test_arrival_errors():
    for kwargs in ({"n": -1}, {"n": 2, "request_rate": 0}, {"n": 2, "request_rate": 1, "burstiness": 0}):
        with pytest.raises(ValueError):
            arrival_times(**kwargs)
