"""The int8 saturation probe (service.worker.quantization.saturation / isa / choice): every
int8 candidate is run on worst-case inputs, a path that saturates is never chosen, and
fbgemm's 7-bit decision follows the instruction set in force (caps in the environment
included). The real kernels of this machine run natively here, and again under the AVX2
cap in a subprocess (``test_the_probe_holds_under_isa_caps``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.worker.quantization import choice
from service.worker.quantization.isa import int8_isa
from service.worker.quantization.paths import (ERROR_BOUNDS, PATHS, LayerWeights, LinearPath,
                                               candidates)
from service.worker.quantization.plan import BUCKETS
from service.worker.quantization.saturation import probe_inputs, saturation_errors
from service.worker.quantization.torch_int8 import Int8Linear, quantize_per_channel

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                reason="int8 needs torch's fbgemm engine (x86-64)")

AVX2_CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
# the oldest the suite can emulate: ATen's scalar kernels, oneDNN on SSE4.1 (fbgemm's
# floor is AVX2)
OLDEST_CAP = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
              "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
CAPPED = "CONVEYOR_TEST_CAPPED"
BOUND = ERROR_BOUNDS["int8"]
K, N = 576, 256  # SmolLM2-135M's hidden size; the probe's channel count


class Int16PairLinear:
    """A software model of a pre-VNNI u8 x s8 GEMM (``vpmaddubsw``): activations uint8 per
    tensor, weights int8 per channel, each adjacent pair's products summed in a saturating
    int16, then int32. Saturates on every CPU, and is close to fp32 on Gaussian inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale = quantize_per_channel(weight)
        self.bias = bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        s = max(hi - lo, 1e-12) / 255
        zp = round(-lo / s)
        xu = (torch.round(x / s) + zp).clamp(0, 255).to(torch.int32)      # [M, K]
        q = self.q.to(torch.int32)                                        # [N, K]
        rows = []
        for r in xu:                                                      # [K]
            pairs = (r * q).view(q.shape[0], -1, 2).sum(-1)               # [N, K/2]
            rows.append(pairs.clamp(-32768, 32767).sum(-1))               # [N]
        acc = torch.stack(rows) - zp * q.sum(1)                           # [M, N]
        y = acc.double() * s * self.scale.double()
        return (y if self.bias is None else y + self.bias.double()).float()


SATURATING = LinearPath("int16-pairs", "int8", False, True,
                        lambda lw: Int16PairLinear(lw.weight, lw.bias), lambda: None)


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setattr(choice, "_load_cache", dict)
    monkeypatch.setattr(choice, "_save_cache", lambda t: None)
    monkeypatch.setattr(choice, "_PROCESS_TIMINGS", {})  # fake timings stay in this test


def test_the_capability_this_test_runs_under_is_reported() -> None:
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"torch CPU capability {cap}; {int8_isa().note()}")
    expected = {"avx2": "AVX2", "default": "DEFAULT"}.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    if expected:
        assert cap == expected


def test_probe_inputs_are_exact_and_reach_the_top_of_the_range() -> None:
    w, x, ref = probe_inputs(8, 16, 8)
    assert w.abs().eq(1).all() and x.abs().max() == 1
    assert torch.equal(ref, (x.double() @ w.double().t()).float())
    assert ref[0, 0] == 16 and ref[1, 0] == -16  # all +1 times all +1, all -1 times all +1
    q, _ = quantize_per_channel(w)
    assert q.abs().eq(127).all()  # weights quantize to the extreme, +127 in adjacent pairs


def test_the_probe_sees_saturation_that_the_random_check_misses() -> None:
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    one_row, _ = choice.relative_errors(SATURATING, LayerWeights(weight, None))
    assert one_row < BOUND  # Gaussian rows never saturate: the old check passed it for 1 row
    errs = saturation_errors(SATURATING, K, N)
    assert len(errs) == len(BUCKETS) and min(errs) > 10 * BOUND
    assert max(saturation_errors(PATHS["fp32"], K, N)) < 1e-6


@pytest.mark.skipif(not int8_isa().reduce_range, reason="fbgemm runs VNNI here: 8 bits is fine")
def test_real_fbgemm_with_8_bit_activations_saturates_without_vnni() -> None:
    eight_bit = dataclasses.replace(
        PATHS["fbgemm"], name="fbgemm-8bit",
        bind=lambda lw: Int8Linear(lw.weight, lw.bias, reduce_range=False))
    assert min(saturation_errors(eight_bit, K, N)) > 10 * BOUND
    assert max(saturation_errors(PATHS["fbgemm"], K, N)) <= BOUND  # 7 bits: decided so here


def test_choice_rejects_a_saturating_path_even_when_it_is_fastest() -> None:
    layers = {"qkv": (torch.randn(N, K), None)}
    timer = (lambda cls, rows, makers:
             {name: 0.1 if name == SATURATING.name else 5.0 for name in makers})
    plan = choice.choose_plan(layers, [PATHS["fp32"], SATURATING], "int8", False,
                              timer=timer, use_cache=False)
    assert plan.choices["qkv"] == ("fp32",) * len(BUCKETS)
    assert min(plan.saturation["qkv"][SATURATING.name]) > BOUND
    assert "worst-case int8 inputs" in plan.table()
    with pytest.raises(ValueError, match="worst-case"):
        choice.choose_plan(layers, [SATURATING], "int8", False, timer=timer, use_cache=False)


@pytest.mark.parametrize("favoured", [p.name for p in candidates("int8", False)
                                      if p.problem() is None])
def test_whatever_is_fastest_the_chosen_plan_is_exact_on_worst_case_inputs(favoured) -> None:
    """Every real int8 candidate of this machine, made the fastest in turn: the plan either
    uses it (it did not saturate) or another path, and is right on the worst case."""
    layers = {"qkv": (torch.randn(N, K, generator=torch.Generator().manual_seed(1)), None)}
    timer = lambda cls, rows, makers: {n: 0.1 if n == favoured else 5.0 for n in makers}
    plan = choice.choose_plan(layers, candidates("int8", False), "int8", False, timer=timer,
                              use_cache=False)
    weight, x, ref = probe_inputs(N, K, max(BUCKETS))
    lin = plan.make_linear("qkv", weight, None)
    for b, rows in enumerate(BUCKETS):
        y = torch.cat([lin(x[i:i + 1]) for i in range(4)]) if rows == 1 else lin(x[:rows])
        r = ref[:y.shape[0]]
        err = float((y - r).norm() / r.norm())
        assert err <= BOUND, (rows, plan.choices["qkv"][b], err)
        sat = plan.saturation["qkv"].get(favoured)
        if sat is not None and sat[b] > BOUND:
            assert plan.choices["qkv"][b] != favoured


@pytest.mark.parametrize(("flags", "env", "fbgemm", "onednn"), [
    ({"avx2"}, {}, False, False),
    ({"avx2", "avx_vnni"}, {}, False, True),              # AVX-VNNI: oneDNN only
    ({"avx512f", "avx512_vnni"}, {}, True, True),
    ({"avx512f", "avx512_vnni"}, {"FBGEMM_ENABLE_INSTRUCTIONS": "avx2"}, False, True),
    ({"avx512f", "avx512_vnni"}, {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX512"}, False, True),
    ({"avx512f", "avx512_vnni"}, {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1"}, True, True),
    ({"avx512f", "avx512_vnni"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, True, False),
    ({"avx512f", "avx512_vnni"}, {"DNNL_MAX_CPU_ISA": "avx512_core"}, True, False),
    ({"avx512f", "avx512_vnni"}, {"ATEN_CPU_CAPABILITY": "avx2"}, False, False),
    ({"avx512f", "avx512_vnni"}, AVX2_CAP, False, False),
])
def test_reduce_range_follows_the_instruction_set_in_force(flags, env, fbgemm, onednn) -> None:
    isa = int8_isa(frozenset(flags), env)
    assert (isa.fbgemm_vnni, isa.onednn_vnni, isa.reduce_range) == (fbgemm, onednn, not fbgemm)
    assert dict(isa.caps) == {k: v for k, v in env.items()}
    assert ("7-bit" in isa.note()) == (not fbgemm)


def test_the_timing_cache_key_follows_the_caps(monkeypatch) -> None:
    for k in AVX2_CAP:
        monkeypatch.delenv(k, raising=False)
    native = choice.cache_key()
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    assert choice.cache_key() != native


@pytest.mark.skipif(bool(os.environ.get(CAPPED)), reason="already a capped run")
@pytest.mark.parametrize("cap", [
    pytest.param(AVX2_CAP, id="avx2"),
    pytest.param(OLDEST_CAP, id="oldest", marks=pytest.mark.slow)])
def test_the_probe_holds_under_isa_caps(cap) -> None:
    """This file's tests of the real kernels again, in a process whose torch is held to
    AVX2 kernels, or the oldest ones it can be held to (the pure tests need no second
    run)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **cap, CAPPED: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          str(Path(__file__).relative_to(root)), "-k",
                          "capability or real or chosen_plan or rejects"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    want = "AVX2" if cap is AVX2_CAP else "DEFAULT"
    assert f"torch CPU capability {want}" in out.stdout, out.stdout[-2000:]
    assert "fbgemm VNNI no" in out.stdout
    assert " passed" in out.stdout and " failed" not in out.stdout
