"""--cpu-bf16-compute and the GGUF blocks' bf16 copy: auto holds it only where it takes at most
BF16_COPY_SHARE of the available memory (an 8B file on a 24 GiB machine keeps its memory
near the file's size); on takes it wherever it fits; off never (ModelRunner._bf16_copy_fits,
with the memory figures faked)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from service.worker import memory_fit, model_runner
from service.worker.memory_fit import BF16_COPY_SHARE, GiB, MemoryNeed, ModelDoesNotFit
from service.worker.model_runner import ModelRunner


def _blocks(weights: int) -> SimpleNamespace:
    """Fake GGUF blocks: one decoder layer of `weights` weights, and an LM head (never
    copied)."""
    layer = SimpleNamespace(out_features=weights // 1024, in_features=1024)
    head = SimpleNamespace(out_features=10**6, in_features=1024)
    return SimpleNamespace(layers={(0, "gate_up"): layer, (None, "lm_head"): head})


def _runner(setting: str) -> SimpleNamespace:
    return SimpleNamespace(_bf16_compute=setting in ("auto", "on"),
                           _bf16_any_share=setting == "on")


@pytest.fixture
def memory(monkeypatch):
    """Available memory (bytes), as the fit check and the share rule see it."""
    state = {"available": 24 * GiB}

    def check_fits(need, name, **_):
        if need.total > state["available"]:
            raise ModelDoesNotFit(f"{name} needs {need.total}")

    monkeypatch.setattr(memory_fit, "check_fits", check_fits)
    monkeypatch.setattr(memory_fit, "available_memory",
                        lambda: (state["available"], "MemAvailable"))
    monkeypatch.setattr(model_runner, "bf16_hardware", lambda: "AVX512-BF16")
    return state


NEED = MemoryNeed(weights=5 * GiB, kv_cache=2 * GiB, swap_space=0)


@pytest.mark.parametrize("setting, copy_gib, fits", [
    ("auto", 2, True),     # 1B-sized copy: 2 GiB of 24
    ("auto", 13, False),   # 8B-sized copy: over a quarter of 24 GiB
    ("on", 13, True),      # on: wherever it fits
    ("on", 20, False),     # 5 + 2 + 20 > 24: does not fit at all
    ("off", 2, False),
])
def test_copy_share(memory, setting, copy_gib, fits, caplog) -> None:
    caplog.set_level(logging.INFO, logger=model_runner.__name__)
    blocks = _blocks(copy_gib * GiB // 2)  # 2 bytes a weight
    got = ModelRunner._bf16_copy_fits(_runner(setting), NEED, blocks, "m")  # type: ignore[arg-type]
    assert got is fits
    if setting == "auto" and copy_gib * GiB > BF16_COPY_SHARE * memory["available"]:
        assert "--cpu-bf16-compute on" in caplog.text


def test_share_follows_the_memory_available(memory) -> None:
    blocks = _blocks(13 * GiB // 2)
    memory["available"] = 64 * GiB  # a bigger server: 13 GiB is within a quarter
    assert ModelRunner._bf16_copy_fits(_runner("auto"), NEED, blocks, "m")  # type: ignore[arg-type]
