"""The quality gate's verdicts on disk (service/worker/quantization/gate_cache.py): a second
start-up on the same model, machine and plan takes the stored verdict, refusals included,
and scores nothing; a changed model file or plan scores again."""

from __future__ import annotations

import os

import pytest

from service.worker.quantization import apply as apply_module
from service.worker.kv_fingerprint import model_identity
from service.worker.quantization.gate_cache import (gate_cache_key, gate_model_for,
                                                    load_verdict, refused_before,
                                                    remember_refusal, store_verdict)
from service.worker.quantization.quality_gate import GateResult, QualityGate
from tests.service.test_bf16_gate import X16, _fake_model, _score_by_paths


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


def _model_file(tmp_path, data: bytes = b"GGUF blocks") -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return str(path)


def test_verdict_round_trips_and_a_missing_one_is_none(tmp_path) -> None:
    key = gate_cache_key(_model_file(tmp_path), _fake_model((3,)), 1001)
    assert key is not None and len(key) == 16
    assert load_verdict(key) is None
    results = [GateResult(2, 1000, 0.999, 12.0, 12.01), GateResult(3, 1000, 0.97, 12.0, 12.5)]
    store_verdict(key, results, [1])
    assert load_verdict(key) == (results, [1])


def test_key_follows_the_model_file_the_plan_the_text_and_the_thresholds(tmp_path) -> None:
    path = _model_file(tmp_path)
    key = gate_cache_key(path, _fake_model((3,)), 1001)
    assert gate_cache_key(path, _fake_model((3,)), 1001) == key  # deterministic
    assert gate_cache_key(path, _fake_model((2, 3)), 1001) != key  # another plan
    assert gate_cache_key(path, _fake_model((3,)), 700) != key  # a shorter text
    assert gate_cache_key(path, _fake_model((3,)), 1001, QualityGate(min_top1=0.99)) != key
    before = model_identity(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file rewritten
    assert model_identity(path) != before
    assert gate_cache_key(path, _fake_model((3,)), 1001) != key
    assert gate_cache_key(str(tmp_path / "absent.gguf"), _fake_model((3,)), 1001) is None


def test_a_rewritten_weight_file_in_a_model_folder_changes_the_key(tmp_path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    key = gate_cache_key(str(folder), _fake_model((3,)), 1001)
    assert key is not None
    (folder / "README.md").write_text("not a weight")
    assert gate_cache_key(str(folder), _fake_model((3,)), 1001) == key
    (folder / "model.safetensors").write_bytes(b"x" * 11)
    assert gate_cache_key(str(folder), _fake_model((3,)), 1001) != key


def test_second_start_takes_the_stored_verdict_and_scores_nothing(tmp_path) -> None:
    path = _model_file(tmp_path)
    linears = _fake_model((2, 3))
    score, seen = _score_by_paths(linears, {512: 0.01, 64: 0.0})
    first = apply_module._scored_or_cached(linears, lambda: (score, 1001), path)
    assert [r.passes() for r in first] == [True, False]
    assert linears[0].names == (X16, X16, "bf16", X16)  # 181+ refused
    assert len(seen) == 3  # reference, 64 rows, 512 rows

    again = _fake_model((2, 3))  # the next start-up's plan: the same choices
    score2, seen2 = _score_by_paths(again, {512: 0.01, 64: 0.0})
    second = apply_module._scored_or_cached(again, lambda: (score2, 1001), path)
    assert second == first and seen2 == []  # nothing scored
    assert again[0].names == (X16, X16, "bf16", X16)  # the refusal applied again
    assert again[0].fns[3] is again[0].fns[1]


def test_unreachable_buckets_are_refused_again_from_the_cache(tmp_path) -> None:
    path = _model_file(tmp_path)
    linears = _fake_model((2, 3))
    score, _ = _score_by_paths(linears, {})
    results = apply_module._scored_or_cached(linears, lambda: (score, 150), path)
    assert [r.bucket for r in results] == [2]  # 181+ cannot be reached by 149 rows
    again = _fake_model((2, 3))
    score2, seen2 = _score_by_paths(again, {})
    apply_module._scored_or_cached(again, lambda: (score2, 150), path)
    assert seen2 == [] and again[0].names == (X16, X16, "bf16", X16)


def test_no_model_path_scores_every_time(tmp_path) -> None:
    for _ in range(2):
        linears = _fake_model((3,))
        score, seen = _score_by_paths(linears, {})
        apply_module._scored_or_cached(linears, lambda: (score, 1001), None)
        assert len(seen) == 2


def test_a_refusal_is_remembered_per_model_and_machine(tmp_path) -> None:
    path = _model_file(tmp_path)
    assert refused_before(path) is None
    linears = _fake_model((2, 3))
    score, _ = _score_by_paths(linears, {512: 0.01, 64: 0.0})
    apply_module._scored_or_cached(linears, lambda: (score, 1001), path)
    assert refused_before(path).startswith("rows 181+: top-1 99.0% of 1000")
    (tmp_path / "other").mkdir()
    assert refused_before(_model_file(tmp_path / "other")) is None  # another file: unknown


def test_passes_and_refusals_for_too_short_a_text_are_not_remembered(tmp_path) -> None:
    path = _model_file(tmp_path)
    remember_refusal(path, [GateResult(3, 1000, 0.999, 12.0, 12.0)])  # passed
    assert refused_before(path) is None
    remember_refusal(path, [GateResult(3, 300, 0.9, 12.0, 12.0)])  # 300 positions: no verdict
    assert refused_before(path) is None
    remember_refusal(path, [GateResult(3, 1000, 0.9, 12.0, 12.0)])
    assert "top-1 90.0% of 1000" in refused_before(path)


def test_the_verdict_is_keyed_to_a_given_model_only_when_it_is_the_named_file(tmp_path):
    named = _model_file(tmp_path)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other blocks")
    # the runner loads it itself: the named model, else the default
    assert gate_model_for(named, "default.gguf", None, given=False) == named
    assert gate_model_for(None, "default.gguf", None, given=False) == "default.gguf"
    # a caller's loaded model: cached only where it came from the named file
    assert gate_model_for(named, "default.gguf", named, given=True) == named
    assert gate_model_for(named, "default.gguf", str(other), given=True) is None
    assert gate_model_for(None, "default.gguf", named, given=True) is None
    assert gate_model_for(named, "default.gguf", None, given=True) is None  # a folder, a test's
    assert gate_model_for(str(tmp_path / "gone.gguf"), "d", named, given=True) is None
