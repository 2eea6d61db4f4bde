"""gguf_index.GGUFIndex against the gguf package's reader: the same tensors (names, types,
shapes, bytes) and scalar metadata, on the default model's file and on written files (with
an alignment of its own); a file it cannot read is refused with ValueError, and GGUFFile
then falls back to the gguf package's reader."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from service.worker.gguf_file import GGUFFile  # noqa: E402
from service.worker.gguf_index import GGUFIndex  # noqa: E402
from service.worker.loader import default_model_path  # noqa: E402


def _same_as_reader(path: str) -> GGUFIndex:
    index = GGUFIndex(path)
    reader = gguf.GGUFReader(path)
    assert list(index.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        got = index.tensors[t.name]
        assert got.tensor_type == t.tensor_type
        assert got.shape == tuple(int(d) for d in t.shape)
        assert np.array_equal(got.data, t.data.view(np.uint8).reshape(-1))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries: version and counts
            continue
        value = index.fields[key]
        if value is None:  # an array stepped over
            continue
        if field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[-1]).decode()
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            assert list(value) == [field.parts[i][0] for i in field.data]
        else:
            assert value == pytest.approx(field.parts[-1][0])
    return index


def test_the_default_models_file_reads_as_the_gguf_package_reads_it() -> None:
    index = _same_as_reader(str(default_model_path()))
    assert index.fields["general.architecture"] == "llama"
    assert index.fields["tokenizer.ggml.tokens"] is None  # 49,152 strings stepped over


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_with_mixed_types_and_alignment(tmp_path, alignment) -> None:
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("test.count", 7)
    w.add_float32("test.eps", 1e-5)
    w.add_string("test.name", "héllo")
    w.add_array("test.small", [1, 2, 3])
    w.add_array("test.words", ["a", "bb", "ccc"])
    rng = np.random.default_rng(0)
    w.add_tensor("norm.weight", rng.standard_normal(48).astype(np.float32))
    w.add_tensor("half.weight", rng.standard_normal((3, 64)).astype(np.float16))
    q = rng.integers(0, 255, size=(4, 18), dtype=np.uint8)  # 4 rows of one Q4_0 block
    w.add_tensor("q.weight", q, raw_shape=(4, 18), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    index = _same_as_reader(path)
    assert index.fields["test.count"] == 7 and index.fields["test.name"] == "héllo"
    assert index.fields["test.small"] == (1, 2, 3) and index.fields["test.words"] is None
    assert index.tensors["q.weight"].shape == (32, 4)
    f = GGUFFile(path)
    kind, rows, k = f.raw("q.weight")
    assert (kind, rows.shape, k) == ("Q4_0", (4, 18), 32) and np.array_equal(rows, q)


def test_what_it_cannot_read_is_refused_and_gguffile_falls_back(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFIndex(str(bad))
    with pytest.raises(ValueError, match="not a GGUF file the gguf package can read"):
        GGUFFile(str(bad))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(default_model_path(), "rb").read(4096))  # the header cut short
    with pytest.raises(ValueError, match="cut short|does not fit"):
        GGUFIndex(str(cut))
