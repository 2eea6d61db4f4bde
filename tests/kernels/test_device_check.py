"""scripts/device_check.py on CPU: the dry run end to end, and its parts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def device_check() -> Iterator[ModuleType]:
    name = "_conveyor_device_check"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "device_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]


def test_dry_run_writes_every_section(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "scripts/device_check.py", "--dry-run", "--skip-e2e"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    report = json.loads((tmp_path / "device_check.json").read_text())
    sections = report["sections"]
    assert proc.returncode == 0, (proc.stdout, proc.stderr, json.dumps(report, indent=1)[:3000])
    assert report["mode"] == "dry-run" and report["ok"] is True
    assert sections["environment"]["status"] == "ok"
    tests = sections["kernel_tests"]
    assert tests["passed_all"] and tests["tests"] > 0 and tests["passed"] == tests["tests"]
    assert sections["copy_bandwidth"]["GBps_read_plus_write"] > 0
    attention = sections["decode_attention"]
    assert attention["within_tolerance"] is True
    for name in ("triton_planned", "triton_unplanned", "torch_ref"):
        assert attention[name]["kv_GBps"] > 0 and attention[name]["fraction_of_copy_bandwidth"] > 0
    assert sections["e2e_greedy"] == {"status": "skipped", "reason": "--skip-e2e"}


def test_gpu_mode_without_gpu_fails_clearly(device_check, tmp_path, monkeypatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "r.json"
    assert device_check.main(["--out", str(out)]) == 2
    assert "no CUDA device" in json.loads(out.read_text())["fatal"]


class _FakeLLM:
    """Deterministic stand-in: the 'cpu/triton' run differs from token 2 of prompt 1."""

    def __init__(self, device: str, attention_backend: str) -> None:
        self.key = f"{device}/{attention_backend}"

    def generate_greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = [[(sum(p) + i) % 50 for i in range(max_tokens)] for p in prompts]
        if self.key == "cpu/triton":
            outs[-1][min(2, max_tokens - 1)] += 1
        return outs


def test_e2e_reports_first_divergence(device_check) -> None:
    plan = device_check.make_plan(dry_run=True)
    plan = type(plan)(**{**plan.__dict__, "e2e_prompts": ((1, 2), (3, 4, 5)), "e2e_max_tokens": 4})
    result = device_check.e2e_greedy(plan, llm_factory=_FakeLLM)
    assert result["compared"] is True and result["all_identical"] is False
    assert result["runs"]["cpu/triton"]["first_divergence"] == [None, 2]
    assert result["runs"]["cpu/triton"]["vs"] == "cpu/torch"


def test_e2e_records_construction_errors_and_import_failure(device_check, monkeypatch) -> None:
    plan = device_check.make_plan(dry_run=True)

    def broken(device: str, attention_backend: str) -> _FakeLLM:
        if attention_backend == "triton":
            raise RuntimeError("kernel exploded")
        return _FakeLLM(device, attention_backend)

    result = device_check.e2e_greedy(plan, llm_factory=broken)
    assert "kernel exploded" in result["runs"]["cpu/triton"]["error"]
    assert result["compared"] is False and result["all_identical"] is False

    monkeypatch.setitem(sys.modules, "service.engine.llm", None)
    result = device_check.e2e_greedy(plan)
    assert result["compared"] is False and "service.engine.llm" in result["import_error"]


def test_first_divergence(device_check) -> None:
    assert device_check.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert device_check.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert device_check.first_divergence([1, 2], [1, 2, 3]) == 2
