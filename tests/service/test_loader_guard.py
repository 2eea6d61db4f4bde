"""The loader refuses, with the fix in its message, to run where Hugging Face's `kernels`
distribution (import name `kernels`, like ours) is installed."""

from __future__ import annotations

import importlib.metadata

import pytest

from service.bench import tokenizer as bench_tokenizer
from service.worker import loader


def _installed(version: str):
    real = importlib.metadata.version

    def fake(name: str) -> str:
        return version if name == "kernels" else real(name)
    return fake


def test_no_hub_kernels_installed_here() -> None:
    loader.check_no_hub_kernels()  # scripts/_setup.sh removes it from the project's venv


@pytest.mark.parametrize("load", [loader.load_model, bench_tokenizer.load_tokenizer])
def test_hub_kernels_installed_fails_before_transformers_with_the_fix(monkeypatch, load) -> None:
    monkeypatch.setattr(loader.importlib.metadata, "version", _installed("0.19.1"))
    with pytest.raises(RuntimeError, match=r"'kernels' package \(0\.19\.1\).*pip uninstall kernels"):
        load(None)
