"""quiet_progress_bars: transformers' load bars off where stderr is not a terminal."""

from __future__ import annotations

import io

from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging

from service.worker.load_progress import quiet_progress_bars


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _gguf_bar_text() -> str:
    out = io.StringIO()
    for _ in gguf_utils.tqdm(range(3), desc="Converting", file=out):
        pass
    return out.getvalue()


def _hf_bar_text() -> str:
    out = io.StringIO()
    for _ in hf_logging.tqdm(range(3), desc="Loading weights", file=out):
        pass
    return out.getvalue()


def test_a_log_file_gets_no_bars_and_they_come_back() -> None:
    assert hf_logging.is_progress_bar_enabled()
    assert "Converting" in _gguf_bar_text() and "Loading weights" in _hf_bar_text()
    with quiet_progress_bars(io.StringIO()) as quiet:
        assert quiet
        assert not hf_logging.is_progress_bar_enabled()
        assert _gguf_bar_text() == "" and _hf_bar_text() == ""
    assert hf_logging.is_progress_bar_enabled()
    assert "Converting" in _gguf_bar_text() and "Loading weights" in _hf_bar_text()


def test_a_terminal_keeps_its_bars() -> None:
    with quiet_progress_bars(_Terminal()) as quiet:
        assert not quiet
        assert hf_logging.is_progress_bar_enabled()
        assert "Converting" in _gguf_bar_text()


def test_bars_off_before_stay_off() -> None:
    hf_logging.disable_progress_bar()
    try:
        with quiet_progress_bars(io.StringIO()):
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_restored_when_the_load_fails() -> None:
    original = gguf_utils.tqdm
    try:
        with quiet_progress_bars(io.StringIO()):
            raise FileNotFoundError("no such model")
    except FileNotFoundError:
        pass
    assert gguf_utils.tqdm is original and hf_logging.is_progress_bar_enabled()
