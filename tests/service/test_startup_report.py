"""What the start-up log reports (issue 23, item 4): the linear layers per weight format
(census), whether the kernel timing cache was used and what was re-timed (choice), and
the router's thresholds (launch). The real model's counts: tests/integration/
test_startup_report_real.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from service.cluster.config import ClusterConfig
from service.cluster.launch import routing_note
from service.engine.metrics import EngineMetrics
from service.worker.quantization import choice
from service.worker.quantization.census import layer_formats, weight_format
from service.worker.quantization.linear import DenseLinear
from service.worker.quantization.paths import PATHS, LayerWeights, LinearPath
from service.worker.quantization.plan import DispatchLinear

HAVE_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


def _dense(n: int = 8, k: int = 16) -> DenseLinear:
    return DenseLinear(torch.randn(n, k))


def test_weight_format_of_every_kind_of_layer() -> None:
    assert weight_format(_dense()) == "fp32"
    assert weight_format(DenseLinear(torch.randn(4, 4, dtype=torch.bfloat16))) == "bf16"
    lw = LayerWeights(torch.randn(64, 64), None)
    for name, fmt in (("cpp-int8-avx2", "int8"), ("cpp-int4-avx2", "int4"),
                      ("int8-dequant-mm", "int8"), ("cpp-f32-avx2", "fp32")):
        if PATHS[name].problem() is None:
            assert weight_format(PATHS[name].bind(lw)) == fmt, name
    if HAVE_FBGEMM:
        assert weight_format(PATHS["fbgemm"].bind(lw)) == "int8"
    mixed = DispatchLinear([_dense()] * 3 + [PATHS["fbgemm"].bind(lw)] if HAVE_FBGEMM
                           else [_dense()] * 4, ("a",) * 4, 16, 8)
    assert weight_format(mixed) == ("fp32+int8" if HAVE_FBGEMM else "fp32")


def test_layer_formats_count_every_layer_so_a_skipped_one_shows() -> None:
    int8 = SimpleNamespace(qweight=None)  # what torch's int8 layers look like to the census
    layers = [SimpleNamespace(qkv=int8, o=int8, gate_up=int8, down=int8) for _ in range(3)]
    layers[1].down = _dense()  # one layer left in fp32
    assert layer_formats(layers, _dense()) == {"int8": 11, "fp32": 2}


def test_engine_metrics_export_the_layer_counts() -> None:
    m = EngineMetrics("M")
    m.set_linear_layers({"int8": 120, "fp32": 1})
    text = m.render().decode()
    assert 'conveyor:linear_layers{format="int8",model_name="M"} 120.0' in text
    assert 'conveyor:linear_layers{format="fp32",model_name="M"} 1.0' in text


def test_the_timing_cache_line_says_found_or_not_and_what_was_retimed(monkeypatch,
                                                                      caplog) -> None:
    store: dict[str, float] = {}
    monkeypatch.setattr(choice, "_load_cache", lambda: dict(store))
    monkeypatch.setattr(choice, "_save_cache", lambda t: store.update(t))
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    path = LinearPath("dense", "none", True, False, lambda lw: DenseLinear(lw.weight, lw.bias),
                      lambda: None)
    layers = {"qkv": (torch.randn(24, 16), None)}
    timer = lambda cls, rows, makers: {n: 1.0 for n in makers}  # noqa: E731
    caplog.set_level(logging.INFO, logger=choice.__name__)

    def cache_line() -> str:
        lines = [r.getMessage() for r in caplog.records if "timing cache" in r.getMessage()]
        caplog.clear()
        return lines[-1]

    choice.choose_plan(layers, [path], "none", False, timer=timer)
    first = cache_line()
    assert "none found" in first and "qkv 24x16 at 1 rows" in first and "512 rows" in first
    choice.choose_plan(layers, [path], "none", False, timer=timer)
    again = cache_line()
    assert "4 timings found" in again and "re-timed: nothing" in again
    store.pop(next(k for k in store if k.endswith("|16")))  # one shape's timing lost
    choice.choose_plan(layers, [path], "none", False, timer=timer)
    partly = cache_line()
    assert "3 timings found" in partly and "re-timed: qkv 24x16 at 16 rows" in partly
    choice.choose_plan(layers, [path], "none", False, timer=timer, use_cache=False)
    assert "not used" in cache_line()


@pytest.mark.parametrize("routing", ["prefix-affinity", "power-of-two"])
def test_routing_note_states_the_thresholds(routing) -> None:
    note = routing_note(ClusterConfig(routing=routing, imbalanced_threshold=6,
                                      match_rate_threshold=0.25))
    if routing == "prefix-affinity":
        assert "balance threshold 6 requests" in note and "match-rate threshold 0.25" in note
    else:
        assert "power of two" in note
