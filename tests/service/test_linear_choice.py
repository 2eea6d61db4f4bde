"""Kernel choice by measurement (service.worker.quantization.choice / plan / paths) with fake
paths and a fake timer: deterministic, no kernel timed."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.packed_parts import unpack_any
from service.worker.quantization import choice, paths
from service.worker.quantization.linear import DenseLinear
from service.worker.quantization.paths import PATHS, LinearPath, candidates
from service.worker.quantization.plan import BUCKETS, DispatchLinear, LinearPlan, bucket_index


def _noisy(lw) -> DenseLinear:
    return DenseLinear(lw.weight * 1.5, lw.bias)  # 50% off: never within a bound


def _fake(name: str, *, wrong: bool = False, problem: str | None = None,
          activations: bool = False) -> LinearPath:
    bind = _noisy if wrong else (lambda lw: DenseLinear(lw.weight, lw.bias))
    return LinearPath(name, "int8", True, activations, bind, lambda: problem)


LAYERS = {"qkv": (torch.randn(24, 16), None), "down": (torch.randn(16, 32), torch.randn(16)),
          "lm_head": (torch.randn(40, 16), None)}
# ms by (path, rows): "slow" is correct everywhere, "fast" wins small, "wrong" is fastest
# but outside the error bound, "big" wins at 64 rows and up
MS = {"slow": 5.0, "wrong": 0.1}


def _ms(name: str, rows: int) -> float:
    if name == "fast":
        return 1.0 if rows <= 16 else 9.0
    if name == "big":
        return 2.0 if rows >= 64 else 7.0
    return MS[name]


def _timer(calls: list):
    def timer(cls, rows, makers):
        calls.extend((name, cls, rows) for name in makers)
        return {name: _ms(name, rows) for name in makers}
    return timer


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    store: dict[str, float] = {}
    monkeypatch.setattr(choice, "_load_cache", lambda: dict(store))
    monkeypatch.setattr(choice, "_save_cache", lambda t: store.update(t))
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})  # fake timings stay in this test
    return store


def test_fastest_correct_path_per_bucket() -> None:
    paths = [_fake("slow"), _fake("wrong", wrong=True), _fake("fast"), _fake("big")]
    calls: list = []
    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=_timer(calls))
    assert plan.choices == {"qkv": ("fast", "fast", "big", "big"),
                            "down": ("fast", "fast", "big", "big"),
                            "lm_head": ("fast", "fast", "big", "big")}
    assert min(plan.errors["qkv"]["wrong"]) > 0.4 and max(plan.errors["qkv"]["fast"]) < 1e-6
    assert all(p != "wrong" for p, _, _ in calls)  # an incorrect path is never timed
    # the LM head's 512 bucket reuses its 64 one (no 512-row timing of a vocab-sized matrix)
    assert ("big", "lm_head", 512) not in calls and ("big", "qkv", 512) in calls
    assert "*fast 1.000" in plan.table() and "qkv=fast,fast,big,big" in plan.summary()


class _PerTensor:
    """Quantizes a call's activations with one range for all its rows (as fbgemm does)."""

    def __init__(self, lw) -> None:
        self.inner = DenseLinear(lw.weight, lw.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        step = x.abs().max() / 127
        return self.inner(torch.round(x / step) * step)


def test_a_per_tensor_path_serves_only_one_row_calls() -> None:
    # an outlier token in an 8-row call ruins the other rows' range: refused there
    paths = [_fake("slow"), LinearPath("pertensor", "int8", False, True, _PerTensor,
                                       lambda: None)]
    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=lambda cls, rows, makers: {
        n: 0.5 if n == "pertensor" else 5.0 for n in makers})
    e1, e8 = plan.errors["qkv"]["pertensor"]
    assert e1 < 0.02 < 0.04 < e8
    assert plan.choices["qkv"] == ("pertensor", "slow", "slow", "slow")
    assert "pertensor" not in plan.timings_ms["qkv"][1]  # not timed where it is wrong


def test_ties_go_to_the_earlier_path_and_pick_needs_a_correct_one() -> None:
    assert choice.pick({"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}, 0.1) == "a"
    assert choice.pick({"a": 1.0, "b": 0.5}, {"a": 0.0, "b": 0.2}, 0.1) == "a"
    assert choice.pick({"a": math.inf}, {"a": 0.0}, 0.1) is None
    assert choice.pick({"a": 1.0}, {}, 0.1) is None


def test_unavailable_paths_are_listed_and_none_left_raises() -> None:
    plan = choice.choose_plan(LAYERS, [_fake("slow"), _fake("gone", problem="no VNNI")],
                              "int8", False, timer=_timer([]))
    assert plan.unavailable == {"gone": "no VNNI"}
    assert set(plan.choices["qkv"]) == {"slow"} and "not available: gone: no VNNI" in plan.table()
    with pytest.raises(ValueError, match="runs here.*gone: no VNNI"):
        choice.choose_plan(LAYERS, [_fake("gone", problem="no VNNI")], "int8", False,
                           timer=_timer([]))
    with pytest.raises(ValueError, match="error bound"):
        choice.choose_plan(LAYERS, [_fake("wrong", wrong=True)], "int8", False, timer=_timer([]))


def test_timings_are_cached_per_machine_but_not_when_busy(_no_disk_cache, monkeypatch) -> None:
    paths = [_fake("slow"), _fake("fast")]
    first: list = []
    choice.choose_plan(LAYERS, paths, "int8", False, timer=_timer(first))
    assert first and len(_no_disk_cache) == len(first)
    again: list = []
    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=_timer(again))
    assert again == [] and plan.choices["qkv"] == ("fast", "fast", "slow", "slow")
    _no_disk_cache.clear()
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    threads: list[int] = []

    def timer(cls, rows, makers):
        threads.append(torch.get_num_threads())
        return {name: _ms(name, rows) for name in makers}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        choice.choose_plan(LAYERS, paths, "int8", False, timer=timer)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert _no_disk_cache == {}  # timed on a busy machine: not kept
    assert threads and set(threads) == {1}  # and on one thread (no barrier to wait at)


def test_contradictory_timings_are_found_per_path_and_layer() -> None:
    t = {"p|8x4|nobias|32|1": 7.4, "p|8x4|nobias|32|16": 0.22, "p|8x4|nobias|32|64": 0.5,
         "q|8x4|nobias|32|1": 1.7, "q|8x4|nobias|32|16": 0.55,  # 3.1x: measured, genuine
         "p|9x4|nobias|32|1": 0.1, "p|9x4|nobias|32|16": 0.2}
    assert choice.contradictions(t) == {"p|8x4|nobias|32|1", "p|8x4|nobias|32|16",
                                        "p|8x4|nobias|32|64"}
    # one of our kernels 10x slower than fp32 at one row (a poisoned cache, as measured
    # beside a test suite): dropped; 3x slower (cpp-f32 on a small layer) is believable
    shared = {"fp32|8x4|nobias|32|1": 0.74, "fp32|8x4|nobias|32|16": 15.9,
              "cpp-q4_1-avx2|8x4|nobias|32|1": 7.7, "cpp-q4_1-avx2|8x4|nobias|32|16": 7.5,
              "cpp-f32-avx2|8x4|nobias|32|1": 2.2, "cpp-f32-avx2|8x4|nobias|32|16": 7.0,
              "bf16|8x4|nobias|32|16": 15.9}
    assert choice.contradictions(shared) == {"cpp-q4_1-avx2|8x4|nobias|32|1",
                                             "cpp-q4_1-avx2|8x4|nobias|32|16"}


def test_contradictory_timings_never_reach_the_disk_and_are_dropped_from_it(
        monkeypatch, tmp_path) -> None:
    import json

    monkeypatch.undo()  # the real cache functions, on a file of this test's own
    path = tmp_path / "timings.json"
    monkeypatch.setattr(choice, "_cache_path", lambda: path)
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    paths = [_fake("slow"), _fake("fast")]

    def shared_cores(cls, rows, makers):  # "fast" at 1 row hit by a neighbour: 30x
        return {n: (30.0 if n == "fast" and rows == 1 else _ms(n, rows)) for n in makers}

    # a process on one thread cannot time on fewer: it lives with the bad timing
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=shared_cores)
    monkeypatch.undo()
    monkeypatch.setattr(choice, "_cache_path", lambda: path)
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert plan.choices["qkv"][0] == "slow"
    saved = json.loads(path.read_text())["timings_ms"]
    assert any(k.startswith("slow|") for k in saved)
    assert not any(k.startswith("fast|") for k in saved)

    # a cache poisoned that way (earlier versions wrote one) is dropped at load, re-timed
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    path.unlink()
    choice.choose_plan(LAYERS, paths, "int8", False, timer=_timer([]))
    saved = json.loads(path.read_text())["timings_ms"]
    one_row = next(k for k in saved if k.startswith("fast|24x16|") and k.endswith("|1"))
    saved[one_row] = 30.0
    path.write_text(json.dumps({"timings_ms": saved}))
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    calls: list = []
    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=_timer(calls))
    assert {("fast", "qkv", 1), ("fast", "qkv", 16)} <= set(calls)  # that path and layer
    assert ("slow", "qkv", 1) not in calls and ("fast", "down", 1) not in calls
    assert plan.choices["qkv"][:2] == ("fast", "fast")


def test_contradictory_timings_are_taken_again_on_one_thread(monkeypatch, tmp_path) -> None:
    # A neighbour holding a core makes a 2-thread call wait at its barrier: on a busy start
    # the C++ paths lost to fp32 at one row and a server decoded unfused for its lifetime.
    monkeypatch.undo()
    path = tmp_path / "timings.json"
    monkeypatch.setattr(choice, "_cache_path", lambda: path)
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    monkeypatch.setattr(choice.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    paths = [_fake("slow"), _fake("fast")]
    seen: list[tuple[str, int, int]] = []

    def neighbour(cls, rows, makers):  # only calls on more than one thread wait
        n = torch.get_num_threads()
        seen.extend((name, rows, n) for name in makers)
        return {m: (30.0 if m == "fast" and rows == 1 and n > 1 else _ms(m, rows))
                for m in makers}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=neighbour)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert ("fast", 1, 2) in seen and ("fast", 1, 1) in seen
    assert plan.choices["qkv"][:2] == ("fast", "fast")  # the one-thread timings decide
    assert not path.exists()  # one-thread timings never go to the disk (key: 2 threads)
    assert choice._PROCESS_TIMINGS  # this process reuses them


def test_bucket_edges_and_dispatch() -> None:
    assert [bucket_index(m) for m in (1, 3, 4, 31, 32, 180, 181, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3]
    seen: list[tuple[int, int]] = []
    fns = [lambda x, i=i: seen.append((i, x.shape[0])) or x for i in range(4)]
    lin = DispatchLinear(fns, ("a", "b", "c", "d"), 8, 8)
    for m in (1, 3, 4, 31, 32, 180, 181, 600):
        lin(torch.zeros(m, 8))
    assert seen == [(bucket_index(m), m) for m in (1, 3, 4, 31, 32, 180, 181, 600)]
    with pytest.raises(ValueError, match="one path per bucket"):
        DispatchLinear(fns[:3], ("a", "b", "c"), 8, 8)


def test_plan_builds_shared_layers_and_knows_what_to_smooth() -> None:
    plan = LinearPlan("int8", False, {"qkv": ("cpp-int8-avx2",) * 4,
                                      "o": ("fp32", "fp32", "fbgemm", "fbgemm"),
                                      "lm_head": ("fbgemm",) * 4})
    assert plan.smoothed_classes() == {"o"}  # never the LM head (tied to the embedding)
    assert not plan.all_fp32()
    w = torch.randn(64, 32)
    single = plan.make_linear("qkv", w, None)
    assert not isinstance(single, DispatchLinear) and single.out_features == 64
    if PATHS["fbgemm"].problem() is None:
        mixed = plan.make_linear("o", w, None)
        assert isinstance(mixed, DispatchLinear) and mixed.names == plan.choices["o"]
        assert mixed.fns[0] is mixed.fns[1] and mixed.fns[2] is mixed.fns[3]
    assert LinearPlan("int8", False, {"qkv": ("fp32",) * 4}).all_fp32()


def test_candidates_per_mode(monkeypatch) -> None:
    monkeypatch.setattr(paths, "bf16_hardware", lambda: "AVX512-BF16")  # auto offers bf16
    int8 = [p.name for p in candidates("int8", False)]
    assert int8[0] == "fp32" and "fbgemm" in int8 and "int_mm" in int8  # never slower than fp32
    assert "cpp-int8-avx2" in int8 and not any("int4" in n for n in int8)
    assert all(p.name.startswith("cpp-int4-") or p.name in ("int4-dequant-mm", "bf16")
               for p in candidates("int4", False))
    assert "bf16" in int8 and "bf16" in [p.name for p in candidates("int4", False)]
    for mode, fmt in (("none", "f32"), ("int8", "int8"), ("int4", "int4")):
        bi = candidates(mode, True)
        assert bi and all(p.name.startswith(f"cpp-{fmt}-") and p.row_invariant for p in bi)
        assert len({p.numerics for p in bi}) == 1  # one numerics: builds may switch per bucket
    assert [p.name for p in candidates("none", False)] == ["fp32"]  # the oracle: never bf16
    auto = candidates("auto", False)
    assert not any(p.quantizes_activations for p in auto)  # auto never quantizes activations
    assert {"fp32", "cpp-f32-avx2", "cpp-q4_1-avx2", "cpp-q8_0-avx2", "bf16"} <= \
        {p.name for p in auto} and not any("int8" in p.name or "int4" in p.name for p in auto)
    assert PATHS["bf16"].min_rows == 16 and PATHS["bf16"].bound("auto") == 0.02
    assert all(p.row_invariant for p in candidates("auto", True))
    assert not any("x8-" in p.name for p in auto + candidates("auto", True))  # exact: fp32 x
    a8 = {p.name for p in candidates("auto-a8", False)}
    assert {p.name for p in auto} | {"cpp-q4_1x8-avx2", "cpp-q8_0x8-avx2"} <= a8
    assert PATHS["cpp-q4_1x8-avx2"].bound("auto-a8") == 0.04
    # int16 activations: in auto (and auto-a8) under their own bound, never --batch-invariant
    x16 = {"cpp-q4_1x16-avx2", "cpp-q8_0x16-avx2"}
    assert x16 <= {p.name for p in auto} and x16 <= a8
    assert PATHS["cpp-q4_1x16-avx2"].bound("auto") == 1e-3
    assert PATHS["cpp-q4_1x16-avx2"].activation_bits == 16
    assert not any(p.activation_bits < 32 for m in ("auto", "auto-a8") for p in candidates(m, True)
                   if "x8-" not in p.name)
    with pytest.raises(ValueError, match="mode"):
        candidates("int3", False)


@pytest.fixture
def fake_calls(monkeypatch):
    """(order, call) on a fake clock: call(name, seconds) is a path's call that appends
    `name` to `order` and advances the clock by its duration. No sleeping, so the order and
    the figures do not depend on how busy the machine is."""
    now = [0.0]
    monkeypatch.setattr(choice, "_clock", lambda: now[0])
    order: list[str] = []

    def call(name: str, seconds: float):
        def run() -> None:
            order.append(name)
            now[0] += seconds
        return run

    return order, call


def test_measure_ms_takes_turns_keeps_the_fastest_call_and_drops_far_losers(fake_calls) -> None:
    order, call = fake_calls
    calls = {"a": [call("a", 0.002), call("a", 0.0005)], "slow": [call("slow", 0.003)] * 2}
    ms = choice.measure_ms(calls, rounds=3)
    assert ms == {"a": pytest.approx(0.5), "slow": pytest.approx(3.0)}
    # round 0: each path's first two calls; in round 1 "slow"'s second call ends its round
    # (5 ms passed)
    assert order[:4] == ["a", "a", "slow", "slow"]
    assert order.count("slow") == 4  # more than 4x behind after round 1: not timed again
    assert order.count("a") > 4
    # over 8x behind after round 0: timed once
    order.clear()
    ms = choice.measure_ms({"a": [call("a", 0.001)] * 2, "hopeless": [call("hopeless", 0.009)]},
                           rounds=3)
    assert ms["hopeless"] == pytest.approx(9.0) and order.count("hopeless") == 1
    assert BUCKETS == (1, 16, 64, 512)


def test_measure_ms_drops_paths_behind_after_round_2_and_keeps_to_its_budget(
        fake_calls) -> None:
    """After round 2 a path over BEHIND x the fastest is not timed again; from round 3 on,
    no round starts once the measurement took budget_s."""
    order, call = fake_calls
    # long calls (one a round each): "near" is 1.2x the fastest, "behind" 2x
    calls = {"fast": [call("fast", 0.030)], "near": [call("near", 0.036)],
             "behind": [call("behind", 0.060)]}
    ms = choice.measure_ms(calls, rounds=5, budget_s=0.25)
    assert ms == {"fast": pytest.approx(30.0), "near": pytest.approx(36.0),
                  "behind": pytest.approx(60.0)}
    assert order.count("behind") == 3  # rounds 0-2, then more than BEHIND x behind
    # rounds 0-2 took 0.378 s > budget_s: no fourth round
    assert order.count("fast") == 3 and order.count("near") == 3
    # short calls: the budget is not reached and all six rounds run; 1.2x is kept, 2x is
    # dropped after round 2
    order.clear()
    calls = {"fast": [call("fast", 0.001)], "near": [call("near", 0.0012)],
             "behind": [call("behind", 0.002)]}
    choice.measure_ms(calls, rounds=5, round_s=0.0005, budget_s=0.25)
    assert order.count("fast") == 6 and order.count("near") == 6
    assert order.count("behind") == 3
    assert choice.BEHIND < choice.FAR_BEHIND and choice.BEHIND > choice.FUSION_SLACK


def _q4_layer(n: int, k: int):
    """A GGUF-like Q4_1 layer: its blocks and their dequantized fp32 weight."""
    from service.worker.gguf_weights import BlockWeight
    g = torch.Generator().manual_seed(n)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // 32, generator=g) * 0.2).half()
    blocks = BlockWeight(("Q4_1",), "q4_1", q, d, m)
    return blocks, blocks.dequantize()


def test_auto_offers_native_paths_only_to_layers_with_their_blocks() -> None:
    """auto on a GGUF file: the q4_1 layer may take cpp-q4_1 (its own blocks, exact) and
    never bf16 (it would round them), the dense one only fp32 / cpp-f32 / bf16; bf16 is not
    timed below 16 rows."""
    blocks, w = _q4_layer(64, 64)
    layers = {"qkv": (w, None), "lm_head": (torch.randn(40, 32), None)}
    paths = [PATHS[n] for n in ("fp32", "cpp-f32-avx2", "cpp-q4_1-avx2", "bf16")
             if PATHS[n].problem() is None]
    calls: list = []

    def timer(cls, rows, makers):
        calls.extend((name, cls, rows) for name in makers)
        return {name: {"cpp-q4_1-avx2": 1.0, "bf16": 0.5}.get(name, 3.0) for name in makers}

    plan = choice.choose_plan(layers, paths, "auto", False, timer=timer, natives={"qkv": blocks})
    names = {p.name for p in paths}
    if "cpp-q4_1-avx2" in names:
        assert plan.choices["qkv"][0] == "cpp-q4_1-avx2"
        assert plan.errors["qkv"]["cpp-q4_1-avx2"][0] < 1e-6
    assert not any(n == "cpp-q4_1-avx2" and cls == "lm_head" for n, cls, _ in calls)
    assert not any(n == "bf16" and rows < 16 for n, _, rows in calls)
    assert plan.choices["lm_head"][1] == "bf16"  # the fake timer has it fastest from 16 rows
    # fastest or not, bf16 is neither timed nor chosen for the layer with blocks
    assert "bf16" not in plan.choices["qkv"]
    assert not any(n == "bf16" and cls == "qkv" for n, cls, _ in calls)
    # a layer without blocks of the chosen format gets a path that can serve it
    mixed = LinearPlan("auto", False, {"qkv": ("cpp-q4_1-avx2",) * 4})
    if "cpp-q4_1-avx2" in names:
        lin = mixed.make_linear("qkv", w, None)
        assert lin.packed.fmt == "f32" and torch.equal(lin(torch.eye(64)[:3]), w.t()[:3])


def test_auto_batch_invariant_keeps_one_numerics_per_layer() -> None:
    blocks, w = _q4_layer(64, 64)
    lw = choice.LayerWeights(w, None, native=blocks)
    got = choice.class_paths(candidates("auto", True), lw, True)
    assert got and len({p.numerics for p in got}) == 1 and got[0].native == "q4_1"
    dense = choice.class_paths(candidates("auto", True), choice.LayerWeights(w, None), True)
    assert dense and all(p.name.startswith("cpp-f32-") for p in dense)
    a8 = choice.class_paths(candidates("auto-a8", True), lw, True)  # its x8 numerics first
    assert a8 and {p.numerics for p in a8} == {"cpp-q4_1x8"}


@pytest.mark.parametrize("cpp_ms, expect", [(1.2, "cpp-x"), (1.3, "fast")])
def test_fusable_buckets_lean_to_cpp_paths_within_the_slack(cpp_ms, expect) -> None:
    # the fused forward needs a C++ kernel on every layer: within FUSION_SLACK (1.25x) of the
    # fastest, one serves the buckets of at most fused_rows rows; larger buckets stay fastest
    paths = [_fake("fast"), _fake("cpp-x")]

    def timer(cls, rows, makers):
        return {n: (cpp_ms if n == "cpp-x" else 1.0) for n in makers}

    plan = choice.choose_plan(LAYERS, paths, "int8", False, timer=timer, fused_rows=16)
    assert plan.choices["qkv"] == (expect, expect, "fast", "fast") and plan.fused_rows == 16
    plain = choice.choose_plan(LAYERS, paths, "int8", False, timer=timer, use_cache=False)
    assert plain.choices["qkv"] == ("fast",) * 4 and plain.fused_rows == 0


def _k_layer(types: tuple[str, ...], n: int, k: int):
    """GGUF K-quant parts of a fused layer: the blocks and their dequantized fp32 weight."""
    from kernels.gguf_pack import dequantize_gguf
    from tests.kernels.test_gguf_pack import random_raw
    from service.worker.gguf_weights import RawBlocks
    raw = tuple(random_raw(t, n, k, seed=i) for i, t in enumerate(types))
    return (RawBlocks(types, tuple(r.numpy() for r in raw), k),
            torch.cat([dequantize_gguf(t, r) for t, r in zip(types, raw)]))


@pytest.mark.parametrize("types, fmt", [(("Q4_K",), "q4_k"), (("Q2_K", "Q3_K", "Q3_K"), "i8_k"), (("Q5_K",), "q5_k"),
                                        (("Q4_K", "Q4_K", "Q6_K"), "split"), (("Q6_K",), "q6_k")])
def test_auto_serves_k_quant_layers_from_their_blocks(types, fmt) -> None:
    blocks, w = _k_layer(types, 64, 256)
    assert blocks.fmt == fmt
    lw = choice.LayerWeights(w, None, native=blocks)
    got = choice.class_paths(candidates("auto", True), lw, True)
    assert got and len({p.numerics for p in got}) == 1 and got[0].native == fmt
    path = f"cpp-{fmt}-avx2"
    assert PATHS[path].mode == "auto" and PATHS[path].accepts(lw)
    assert not PATHS["cpp-q4_1-avx2"].accepts(lw)
    assert PATHS["bf16"] not in choice.class_paths(list(PATHS.values()), lw, False, True)
    assert f"{fmt}-dequant-mm" in PATHS
    x16 = PATHS[f"cpp-{fmt}x16-avx2"]  # int16 activations: auto's, not --batch-invariant's
    assert x16.native == fmt and x16.activation_bits == 16 and x16.bound("auto") == 1e-3
    assert x16 in candidates("auto", False) and x16 not in candidates("auto", True)
    if PATHS[path].problem() is not None:
        return
    layers = {"qkv": (w, None)}

    def timer(cls, rows, makers):
        return {name: 1.0 if name == path else 3.0 for name in makers}

    plan = choice.choose_plan(layers, [PATHS[n] for n in ("fp32", "cpp-f32-avx2", path)], "auto",
                              False, timer=timer, natives={"qkv": blocks})
    assert plan.choices["qkv"][0] == path and plan.errors["qkv"][path][0] < 1e-6
    lin = PATHS[path].bind(lw)
    assert lin.packed.fmt == fmt and torch.equal(unpack_any(lin.packed), w)
    lin16 = x16.bind(lw)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    want = x.double() @ w.double().t()
    assert lin16.packed.fmt == f"{fmt}x16"
    parts = (lambda p: p.parts if fmt == "split" else (p,))
    assert all(a.data is b.data for a, b in zip(parts(lin16.packed), parts(lin.packed)))
    assert float((lin16(x).double() - want).norm() / want.norm()) < 1e-4


def test_a_blocks_only_layer_is_checked_on_each_parts_first_rows() -> None:
    from kernels.gguf_pack import dequantize_gguf
    from service.worker.gguf_weights import RawBlocks
    from tests.kernels.test_gguf_pack import random_raw
    types, rows = ("Q4_K", "Q4_K", "Q6_K"), (300, 40, 280)
    raw = tuple(random_raw(t, n, 256, seed=i).numpy() for i, (t, n) in enumerate(zip(types, rows)))
    blocks = RawBlocks(types, raw, 256)
    bias = torch.randn(sum(rows))
    lw = choice.LayerWeights(None, bias, native=blocks)
    sample = lw.check_sample(choice.CHECK_OUT_ROWS)
    # every part keeps its first 256 rows (all of the 40), in order, with their bias
    assert sample.shape == (256 + 40 + 256, 256) and sample.native.gguf_types == types
    keep = torch.cat([torch.arange(256), 300 + torch.arange(40), 340 + torch.arange(256)])
    assert torch.equal(sample.bias, bias[keep])
    want = torch.cat([torch.from_numpy(dequantize_gguf(t, torch.from_numpy(r)).numpy())
                      for t, r in zip(types, raw)])
    assert torch.equal(sample.weight, want[keep])
    assert lw.check_sample(1000) is lw  # nothing to cut
    dense = choice.LayerWeights(want, bias)
    assert dense.check_sample(8) is dense  # a dense layer is checked whole
    path = PATHS["cpp-split-avx2"]
    if path.problem() is not None:
        return

    def timer(cls, n, makers):
        return {name: 1.0 for name in makers}

    plan = choice.choose_plan({"qkv": (None, bias)}, [path], "auto", False, timer=timer,
                              natives={"qkv": blocks}, native_only=True, use_cache=False)
    assert plan.choices["qkv"][0] == path.name and plan.errors["qkv"][path.name][0] < 1e-6


def test_a_timing_sample_keeps_each_parts_share_in_whole_blocks() -> None:
    from kernels.gguf_pack import dequantize_gguf
    from service.worker.gguf_weights import BlockWeight, RawBlocks
    from tests.kernels.test_gguf_pack import random_raw
    types, rows = ("Q4_K", "Q4_K", "Q6_K"), (2048, 512, 512)
    raw = tuple(random_raw(t, n, 256, seed=i).numpy() for i, (t, n) in enumerate(zip(types, rows)))
    bias = torch.randn(sum(rows))
    lw = choice.LayerWeights(None, bias, native=RawBlocks(types, raw, 256))
    sample, scale = lw.timing_sample(512)
    # a sixth of each part, rounded up to whole 64-channel blocks: 384 + 128 + 128
    assert sample.shape == (640, 256) and sample.native.gguf_types == types
    assert scale == pytest.approx(3072 / 640)
    keep = torch.cat([torch.arange(384), 2048 + torch.arange(128), 2560 + torch.arange(128)])
    want = torch.cat([dequantize_gguf(t, torch.from_numpy(r)) for t, r in zip(types, raw)])
    assert torch.equal(sample.weight, want[keep]) and torch.equal(sample.bias, bias[keep])
    assert lw.timing_sample(1536) == (lw, 1.0)  # at most twice the sample: timed whole
    dense, dense_scale = choice.LayerWeights(want, bias).timing_sample(100)
    assert torch.equal(dense.weight, want[:128]) and dense_scale == 3072 / 128
    q = torch.randint(0, 16, (3072, 64), dtype=torch.uint8)
    d, m = torch.rand(3072, 2).half(), torch.rand(3072, 2).half()
    blocks = BlockWeight(("Q4_1",), "q4_1", q, d, m)
    cut, _ = choice.LayerWeights(None, None, native=blocks).timing_sample(512)
    assert torch.equal(cut.weight, blocks.dequantize()[:512])


def test_compute_bound_buckets_are_timed_on_a_sample_and_scaled() -> None:
    layers = {"gate_up": (torch.randn(3000, 16), torch.randn(3000))}
    seen: dict[int, list[int]] = {}

    def timer(cls, rows, makers):  # a call costs 1 ms plus 10 ms per 1000 channels
        out = {}
        for name, make in makers.items():
            channels = int(make()[0]().shape[1])  # the output channels each call computes
            seen.setdefault(rows, []).append(channels)
            out[name] = 1.0 + channels / 100
        return out

    plan = choice.choose_plan(layers, [_fake("slow")], "int8", False, timer=timer)
    n, b = choice.SAMPLE_CHANNELS, paths.SAMPLE_BLOCK
    # whole below 64 rows; from 64, the sample and one block, the line through both
    assert seen == {1: [3000], 16: [3000], 64: [n, b], 512: [n, b]}
    assert [row["slow"] for row in plan.timings_ms["gate_up"]] == \
        pytest.approx([31.0, 31.0, 31.0, 31.0])


def test_a_path_is_offered_from_its_min_rows_unless_it_is_the_only_one() -> None:
    big_only = LinearPath("big-only", "int8", True, False,
                          lambda lw: DenseLinear(lw.weight, lw.bias), lambda: None, min_rows=64)
    calls: list = []
    plan = choice.choose_plan(LAYERS, [_fake("slow"), big_only], "int8", False,
                              timer=_timer_of({"slow": 5.0, "big-only": 1.0}, calls))
    assert plan.choices["qkv"] == ("slow", "slow", "big-only", "big-only")
    assert ("big-only", "qkv", 16) not in calls and ("big-only", "qkv", 64) in calls
    alone = choice.choose_plan(LAYERS, [big_only], "int8", False, use_cache=False,
                               timer=_timer_of({"big-only": 1.0}, []))
    assert alone.choices["qkv"] == ("big-only",) * 4  # nothing else: offered everywhere
    assert all(PATHS[n].min_rows == paths.DEQUANT_MIN_ROWS for n in PATHS
               if n.endswith("-dequant-mm"))


def _timer_of(ms: dict, calls: list):
    def timer(cls, rows, makers):
        calls.extend((name, cls, rows) for name in makers)
        return {name: ms[name] for name in makers}
    return timer


def test_a_samples_time_is_scaled_along_the_line_through_two_samples() -> None:
    assert choice.scaled_ms(2.0, 4.0) == 8.0  # proportional without a smaller sample
    # 10 ms on a quarter, 5.2 on a tenth: 2 ms fixed, 32 ms a whole layer's channels
    assert choice.scaled_ms(10.0, 4.0, 5.2, 10.0) == pytest.approx(2 + 32)
    assert choice.scaled_ms(10.0, 4.0, 12.0, 10.0) == 40.0  # noise: the smaller one slower
    assert choice.scaled_ms(10.0, 4.0, 1.5, 10.0) == 40.0  # superlinear: no fixed part
    # a smaller sample as slow as the sample: the fixed part is capped at FIXED_SHARE_MAX
    cap = choice.FIXED_SHARE_MAX
    assert choice.scaled_ms(10.0, 4.0, 9.9999, 10.0) == pytest.approx(10 * (cap + (1 - cap) * 4))
    # too short a smaller sample to read a fixed part from (thread wake-ups): proportional
    assert choice.scaled_ms(1.0, 4.0, 0.52, 10.0) == 4.0


def test_a_layer_in_another_format_than_its_class_keeps_the_chosen_activations() -> None:
    # Q4_K_M: layer 0's qkv is split (a Q6_K v), layer 2's all Q4_K: the plan chosen on layer
    # 0 serves layer 2 with q4_k's own paths, int16 activations where the choice took them
    from service.worker.quantization.plan import substitute
    split, _ = _k_layer(("Q4_K", "Q4_K", "Q6_K"), 64, 256)
    plain, w = _k_layer(("Q4_K", "Q4_K", "Q4_K"), 64, 256)
    lw = choice.LayerWeights(None, None, native=plain)
    assert substitute("cpp-splitx16-avx2", lw, False) == "cpp-q4_kx16-avx2"
    assert substitute("cpp-split-avx512", lw, True) == "cpp-q4_k-avx512"
    assert substitute("split-dequant-mm", lw, False).startswith("cpp-q4_k-")
    dense = choice.LayerWeights(w, None)
    assert substitute("cpp-splitx16-avx2", dense, False) == "cpp-f32-avx2"
    plan = LinearPlan("auto", False, {"qkv": ("cpp-split-avx2",) * 2 + ("cpp-splitx16-avx2",) * 2},
                      natives={(0, "qkv"): split, (2, "qkv"): plain})
    if PATHS["cpp-split-avx2"].problem() is not None:
        return
    assert plan.make_linear("qkv", None, None, layer=2).names == \
        ("cpp-q4_k-avx2",) * 2 + ("cpp-q4_kx16-avx2",) * 2
    first = plan.make_linear("qkv", None, None, layer=0)
    assert first.names == plan.choices["qkv"] and first.fns[0].packed.fmt == "split"
