"""The KV fingerprint changes with everything that changes KV bytes (another model file,
dtype, block size, layout, rope, quantization, batch invariance, device), and only then."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from service.worker.kv_fingerprint import fingerprint_digest, kv_fingerprint_fields


def runner(**kw) -> SimpleNamespace:
    model = SimpleNamespace(num_layers=kw.pop("num_layers", 30), num_kv_heads=3, head_dim=64)
    loaded = SimpleNamespace(inv_freq=kw.pop("inv_freq", torch.arange(1.0, 33.0)),
                             attention_scaling=1.0,
                             hf_config=SimpleNamespace(rope_theta=kw.pop("rope_theta", 1e4),
                                                       rope_scaling=None))
    base = dict(loaded=loaded, model=model, dtype=torch.float32, block_size=16,
                quantization="auto", batch_invariant=False, device=torch.device("cpu"))
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    return path


def digest(r, path) -> bytes:
    return fingerprint_digest(kv_fingerprint_fields(r, path))


def test_same_settings_same_digest(model_file):
    assert digest(runner(), model_file) == digest(runner(), model_file)


@pytest.mark.parametrize("change", [
    {"dtype": torch.bfloat16}, {"block_size": 32}, {"num_layers": 29},
    {"quantization": "int8"}, {"quantization": None}, {"batch_invariant": True},
    {"device": torch.device("cuda")}, {"rope_theta": 5e5},
    {"inv_freq": torch.arange(1.0, 33.0) * 1.0001},
])
def test_each_kv_setting_changes_the_digest(model_file, change):
    assert digest(runner(**change), model_file) != digest(runner(), model_file)


def test_another_model_file_or_a_rewritten_one_changes_the_digest(model_file, tmp_path):
    before = digest(runner(), model_file)
    other = tmp_path / "other.gguf"
    other.write_bytes(model_file.read_bytes())
    assert digest(runner(), other) != before  # another path
    st = model_file.stat()
    os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert digest(runner(), model_file) != before  # same path, rewritten


def test_an_hf_folder_counts_its_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(bytes(10))
    (tmp_path / "README.md").write_text("notes")
    before = digest(runner(), tmp_path)
    (tmp_path / "README.md").write_text("other notes")  # not part of the model
    assert digest(runner(), tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(bytes(11))
    assert digest(runner(), tmp_path) != before
