"""16-bit compute in the auto modes: which layers and buckets may take bf16, and the quality
gate that keeps or refuses it (service/worker/quantization/quality_gate.py), with fakes."""

from __future__ import annotations

import math

import pytest
import torch

from service.worker.quantization import choice, paths
from service.worker.quantization.apply import sixteen_bit_summary
from service.worker.quantization.paths import PATHS, BF16Linear, candidates
from service.worker.quantization.plan import DispatchLinear
from service.worker.quantization.quality_gate import (GateResult, Predictions, QualityGate,
                                                      bf16_buckets, compare, exact,
                                                      predictions, run_gate)
from tests.service.test_linear_choice import _q4_layer

X16 = "cpp-q4_1x16-avx2"


def _preds(top1: list[int], nll: list[float]) -> Predictions:
    return Predictions(torch.tensor(top1), torch.tensor(nll, dtype=torch.float64))


def test_compare_counts_agreement_and_perplexities() -> None:
    ref = _preds([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0])
    got = _preds([1, 2, 3, 5], [1.0, 1.0, 1.0, 1.2])
    r = compare(3, ref, got)
    assert r.positions == 4 and r.top1 == 0.75
    assert r.perplexity_ref == pytest.approx(math.e)
    assert r.perplexity == pytest.approx(math.exp(1.05))
    assert r.perplexity_change == pytest.approx(math.exp(0.05) - 1)
    with pytest.raises(ValueError):
        compare(3, ref, _preds([1], [1.0]))


def test_perplexities_past_a_float_are_compared_by_their_mean_nll() -> None:
    """A random-weight file's text can have a mean NLL of hundreds of nats: exp overflows
    (perplexity inf for both), and the change comes from the NLLs' difference instead of
    reading inf and refusing every bucket."""
    ref = _preds([1, 2, 3, 4], [800.0] * 4)
    close = compare(3, ref, _preds([1, 2, 3, 4], [800.0, 800.0, 800.0, 800.004]))
    assert close.perplexity == close.perplexity_ref == math.inf
    assert close.perplexity_change == pytest.approx(math.expm1(0.001))
    assert close.passes(QualityGate(min_positions=4))
    assert "mean NLL 800 vs 800 nats (perplexity +0.10%)" in close.describe()
    far = compare(3, ref, _preds([1, 2, 3, 4], [800.0, 800.0, 800.0, 804.0]))
    assert far.perplexity_change == pytest.approx(math.expm1(1.0))
    assert not far.passes(QualityGate(min_positions=4))
    bad = compare(3, ref, _preds([1, 2, 3, 4], [800.0, 800.0, 800.0, math.inf]))
    assert bad.perplexity_change == math.inf and not bad.passes(QualityGate(min_positions=4))
    # stored before the NLLs were kept: None, and an overflow reads as before (refused)
    assert GateResult(3, 1000, 1.0, math.inf, math.inf).perplexity_change == math.inf


def test_predictions_are_each_rows_argmax_and_next_token_nll() -> None:
    logits = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    p = predictions(logits, [1, 2])  # the third row has no next token
    assert p.top1.tolist() == [1, 0]
    want = -torch.log_softmax(logits[:2].double(), -1)[[0, 1], [1, 2]]
    torch.testing.assert_close(p.nll, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top1, change, ok", [(0.995, 0.005, True), (0.994, 0.0, False),
                                              (1.0, 0.0051, False), (1.0, -0.0051, False),
                                              (1.0, -0.0049, True)])
def test_gate_thresholds_are_issue_47s(top1, change, ok) -> None:
    r = GateResult(3, 1000, top1, 10.0, 10.0 * (1 + change))
    assert r.passes() is ok and r.passes(QualityGate(min_top1=0.9, max_perplexity_change=0.01))
    assert "rows 181+" in r.describe()
    assert not GateResult(3, 10, 1.0, 10.0, math.inf).passes()
    with pytest.raises(ValueError, match="min_top1"):
        QualityGate(min_top1=0.0)
    with pytest.raises(ValueError, match="max_perplexity_change"):
        QualityGate(max_perplexity_change=-1.0)


class _Fn:
    """A fake path: says which it is when called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, x: torch.Tensor) -> str:
        return self.name


def _layer(names: tuple[str, ...]) -> DispatchLinear:
    fns = {n: _Fn(n) for n in names}
    return DispatchLinear([fns[n] for n in names], names, 8, 8)


def _fake_model(bf16_at: tuple[int, ...]) -> list[DispatchLinear]:
    names = tuple("bf16" if b in bf16_at else X16 for b in range(4))
    return [_layer(names), _layer(names), _layer((X16,) * 4)]


def _score_by_paths(linears, bad_rows: dict[int, float]):
    """A fake score: the argmax of 1,000 positions, of which the fraction bad_rows[rows]
    moves when a layer's call at that many rows runs bf16."""
    seen = []

    def score(rows: int) -> Predictions:
        x = torch.zeros(rows, 8)
        used = {lin(x) for lin in linears}
        seen.append((rows, frozenset(used)))
        top1 = torch.zeros(1000, dtype=torch.int64)
        if "bf16" in used:
            top1[:int(1000 * bad_rows.get(rows, 0.0))] = 1
        return Predictions(top1, torch.ones(1000, dtype=torch.float64))

    return score, seen


def test_gate_keeps_bf16_where_it_passes_and_the_reference_is_exact() -> None:
    linears = _fake_model((2, 3))
    assert bf16_buckets(linears) == [2, 3]
    score, seen = _score_by_paths(linears, {512: 0.002, 64: 0.001})
    results = run_gate(linears, score, 1001)
    # the reference ran without bf16 anywhere (each bf16 bucket on the bucket below's path)
    assert seen[0] == (512, frozenset({X16}))
    assert [r.bucket for r in results] == [2, 3] and all(r.passes() for r in results)
    assert [rows for rows, _ in seen] == [512, 64, 512]
    assert linears[0].names == (X16, X16, "bf16", "bf16")  # kept, and exact() restored them
    assert linears[0].fns[3].name == "bf16"


def test_gate_refuses_a_bucket_that_moves_the_argmax_and_serves_the_one_below() -> None:
    linears = _fake_model((2, 3))
    score, _ = _score_by_paths(linears, {512: 0.01, 64: 0.0})
    results = run_gate(linears, score, 1001)
    assert [r.passes() for r in results] == [True, False]
    assert results[1].top1 == pytest.approx(0.99)
    # the refused 512-row bucket is served by the 64-row bucket's path below it... which is
    # bf16 too (it passed): the nearest bucket that does not round the weights serves it
    assert linears[0].names == (X16, X16, "bf16", X16)
    assert linears[0].fns[3] is linears[0].fns[1]
    assert bf16_buckets(linears) == [2]


def test_exact_restores_the_chosen_paths() -> None:
    linears = _fake_model((3,))
    with exact(linears):
        assert linears[0](torch.zeros(512, 8)) == X16
    assert linears[0](torch.zeros(512, 8)) == "bf16"
    assert run_gate(_fake_model(()), lambda rows: pytest.fail("no bf16: nothing to score"),
                    1001) == []


def test_gate_refuses_buckets_its_text_cannot_reach_and_too_few_positions() -> None:
    linears = _fake_model((2, 3))
    score, seen = _score_by_paths(linears, {})
    results = run_gate(linears, score, 150)  # 149 rows at most: no call of 181+ rows
    assert [r.bucket for r in results] == [2] and results[0].passes()
    assert linears[0].names == (X16, X16, "bf16", X16)  # 181+ refused, untested
    assert [rows for rows, _ in seen] == [512, 64]
    # a KV cache that holds too little text to tell 99.5% from 99%: refused
    assert not GateResult(2, 399, 1.0, 5.0, 5.0).passes()
    assert GateResult(2, 400, 1.0, 5.0, 5.0).passes()


def test_summary_names_the_buckets_and_the_bf16_bytes() -> None:
    w = torch.randn(16, 8)
    bf = BF16Linear(w, None)
    lin = DispatchLinear([_Fn(X16), _Fn(X16), bf, bf], (X16, X16, "bf16", "bf16"), 8, 16)
    where, held = sixteen_bit_summary([("gate_up", lin), ("lm_head", _Fn(X16))])
    assert where == "rows 32-180: gate_up; rows 181+: gate_up" and held == 16 * 8 * 2
    assert sixteen_bit_summary([("qkv", _Fn(X16))]) == ("", 0)


@pytest.mark.parametrize("hardware", [None, "AVX512-BF16", "AMX"])
def test_auto_offers_bf16_only_with_bf16_hardware_and_the_setting(monkeypatch, hardware) -> None:
    monkeypatch.setattr(paths, "bf16_hardware", lambda: hardware)
    for mode in ("auto", "auto-a8"):
        names = {p.name for p in candidates(mode, False)}
        assert ("bf16" in names) is (hardware is not None)
        assert "bf16" not in {p.name for p in candidates(mode, False, bf16=False)}
        assert "bf16" not in {p.name for p in candidates(mode, True)}  # batch-invariant
    assert "bf16" in {p.name for p in candidates("int8", False)}  # int8's own choice
    assert [p.name for p in candidates("none", False)] == ["fp32"]


def test_block_layers_take_bf16_only_where_round_blocks_allows(monkeypatch) -> None:
    monkeypatch.setattr(paths, "bf16_hardware", lambda: "AVX512-BF16")
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})
    blocks, w = _q4_layer(64, 64)
    lw = choice.LayerWeights(w, None, native=blocks)
    offered = candidates("auto", False)
    for native_only in (False, True):
        assert PATHS["bf16"] not in choice.class_paths(offered, lw, False, native_only)
        got = choice.class_paths(offered, lw, False, native_only, round_blocks=True)
        assert PATHS["bf16"] in got
        assert all(p.native or p.rounds_weights for p in got) if native_only else True
    # the choice: bf16 timed for a layer with blocks only at 512 rows (BF16_BLOCKS_MIN_ROWS)
    # and chosen there where the fake timer has it fastest, for the class round_blocks names
    layers = {"qkv": (w, None), "o": (w, None)}
    usable = [p for p in offered if p.problem() is None
              and p.name in ("fp32", "cpp-f32-avx2", "cpp-q4_1-avx2", X16, "bf16")]

    timed = []

    def timer(cls, rows, makers):
        timed.extend((cls, rows) for n in makers if n == "bf16")
        return {n: 0.5 if n == "bf16" else 1.0 for n in makers}

    plan = choice.choose_plan(layers, usable, "auto", False, timer=timer, use_cache=False,
                              natives={"qkv": blocks, "o": blocks}, native_only=True,
                              round_blocks=frozenset({"qkv"}))
    assert plan.choices["qkv"][3] == "bf16" and "bf16" not in plan.choices["qkv"][:3]
    assert "bf16" not in plan.choices["o"]
    assert timed == [("qkv", 512)]
