"""The agentic workload's arithmetic (service.bench.agentic): percentiles and the summary
of a run's records (hit rate, tokens computed, first vs returning turns)."""

from __future__ import annotations

from service.bench.agentic import percentile, summarize


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 0) == 1.0


def test_summary_splits_first_and_returning_turns():
    records = [
        {"session": 0, "turn": 0, "prompt_tokens": 100, "cached_tokens": 0, "ttft_ms": 900.0,
         "disk_cached_tokens": 0},
        {"session": 1, "turn": 0, "prompt_tokens": 100, "cached_tokens": 0, "ttft_ms": 1100.0,
         "disk_cached_tokens": 0},
        {"session": 0, "turn": 1, "prompt_tokens": 140, "cached_tokens": 96, "ttft_ms": 200.0,
         "disk_cached_tokens": 96},
        {"session": 1, "turn": 1, "prompt_tokens": 140, "cached_tokens": 128, "ttft_ms": 100.0,
         "disk_cached_tokens": 112},
    ]
    s = summarize(records, {"prefix_disk_hits": 224}, first_turn=0)
    assert s["prompt_tokens"] == 480 and s["cached_tokens"] == 224
    assert s["hit_rate"] == round(224 / 480, 4) and s["prompt_tokens_computed"] == 256
    assert s["ttft_ms_first_turns_p50"] in (900.0, 1100.0)
    assert s["ttft_ms_returning_p50"] in (100.0, 200.0) and s["ttft_ms_returning_p99"] == 200.0
    assert s["prefix_disk_hits"] == 224
    assert s["hit_rate_returning"] == round(224 / 280, 4) and s["disk_cached_tokens"] == 208
