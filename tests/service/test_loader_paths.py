"""--model paths the loader cannot read: a missing one says so, another kind of file says
what --model takes (FileNotFoundError, printed by `conveyor serve` as one line)."""

from __future__ import annotations

import pytest

from service.worker.loader import load_model


def test_a_missing_model_path_says_so(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_model(str(tmp_path / "nope.gguf"))


def test_another_kind_of_file_says_what_model_takes(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a folder"):
        load_model(str(tmp_path / "notes.txt"))
