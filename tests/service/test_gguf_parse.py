"""service.worker.gguf_parse: inside shared_gguf_parse() a GGUF file is parsed once and a
tensor name map built once, nested contexts share them, and leaving the outermost one puts
gguf's own functions back and drops the parsed files (they hold about 167 MB for the
default model). A small file written here with gguf's own writer."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from service.worker.gguf_parse import parses, shared_gguf_parse  # noqa: E402


def _write(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_one_parse_per_file_and_one_name_map_while_open(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with shared_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and parses() == 1
        assert isinstance(first, reader_cls) and "token_embd.weight" in {t.name for t in first.tensors}
        with shared_gguf_parse():  # load_model's own context inside a ModelRunner's
            from gguf import GGUFReader  # as transformers imports it, at call time
            assert GGUFReader(path) is first
        assert gguf.GGUFReader(path) is first  # the inner exit dropped nothing
        names = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is names
        assert gguf.get_tensor_name_map(arch, 3) is not names
        assert names.get_name("model.embed_tokens") == "token_embd"
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map_fn
    assert parses() == 0
    assert gguf.GGUFReader(path) is not first  # outside: a fresh parse each time


def test_an_error_inside_restores_gguf(tmp_path) -> None:
    reader_cls = gguf.GGUFReader
    with pytest.raises(FileNotFoundError), shared_gguf_parse():
        gguf.GGUFReader(tmp_path / "missing.gguf")
    assert gguf.GGUFReader is reader_cls and parses() == 0
