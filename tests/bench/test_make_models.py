"""scripts/make_models on a tiny custom shape: llama.cpp's per-tensor types, shapes, and the
files read back through gguf.GGUFReader and transformers (config, and the weights of the
bf16 folder)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize

from service.bench.gguf_blocks import QUANTIZED, random_blocks
from service.bench.gguf_writer import write_gguf
from service.bench.gguf_types import FILE_TYPES, tensor_type, use_more_bits
from service.bench.hf_model import write_hf_folder
from service.bench.make_models import main
from service.bench.model_shapes import SHAPES, ModelShape, llama3_rope_factors, tensors
from service.worker.loader import default_model_path

# 8 layers: use_more_bits holds for 0, 3, 6, 7 (first and last eighth, every third between)
TINY = ModelShape("tiny", "llama", "llama", hidden=256, layers=8, heads=4, kv_heads=2,
                  head_dim=64, ffn=512, tied=True, rope_theta=500000.0, rms_eps=1e-5,
                  context=2048, rope_scaling={"factor": 32.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192,
                                              "rope_type": "llama3"})
TINY_QWEN = ModelShape("tiny-qwen", "qwen2", "qwen2", hidden=256, layers=4, heads=4,
                       kv_heads=2, head_dim=64, ffn=768, tied=False, rope_theta=1e6,
                       rms_eps=1e-6, context=1024, qkv_bias=True)


@pytest.mark.parametrize("t", sorted(QUANTIZED, key=lambda t: t.name), ids=lambda t: t.name)
def test_random_blocks_have_the_std_and_no_common_mean(t):
    # [256 rows x 1024] of each type: the asked standard deviation, about zero mean, and the
    # rows' means of either sign (no direction shared by every row: Q4_0's -0.5 d once was)
    std = 0.03
    raw = random_blocks(np.random.default_rng(5), t, 256, 1024, std)
    w = dequantize(raw, t).reshape(256, 1024).astype(np.float64)
    assert 0.9 * std < w.std() < 1.1 * std
    assert abs(w.mean()) < 0.01 * std
    row_means = w.mean(axis=1)
    assert abs(row_means.mean()) < 0.2 * row_means.std()


def test_use_more_bits_layers():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(28) if use_more_bits(i, 28)] == \
        [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf"
    types = write_gguf(path, TINY, FILE_TYPES["Q4_K_M"], seed=1,
                       tokenizer_gguf=default_model_path())
    return path, types


def test_q4_k_m_types_follow_llama_cpp(tiny_q4_k_m):
    path, types = tiny_q4_k_m
    more = {0, 3, 6, 7}
    for i in range(TINY.layers):
        want = T.Q6_K if i in more else T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == want, i
        assert types[f"blk.{i}.ffn_down.weight"] == want, i
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{n}.weight"] == T.Q4_K, (i, n)
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32
    assert types["token_embd.weight"] == T.Q6_K   # tied: quantized as the output
    assert types["rope_freqs.weight"] == T.F32 and "output.weight" not in types
    # what the file says is what the writer chose
    reader = GGUFReader(path)
    assert {t.name: t.tensor_type for t in reader.tensors} == types


def test_other_file_types_follow_llama_cpp():
    specs = {t.gguf_name: t for t in tensors(TINY_QWEN)}

    def ty(name, ft):
        return tensor_type(specs[name], FILE_TYPES[ft], TINY_QWEN.layers, TINY_QWEN.tied)

    assert ty("output.weight", "Q4_0") == T.Q6_K and ty("token_embd.weight", "Q4_0") == T.Q4_0
    assert ty("blk.0.attn_v.weight", "Q4_0") == T.Q4_0
    assert ty("output.weight", "Q8_0") == T.Q8_0 and ty("blk.0.ffn_down.weight", "Q8_0") == T.Q8_0
    assert ty("output.weight", "Q6_K") == T.Q6_K and ty("blk.1.attn_q.weight", "Q6_K") == T.Q6_K
    # 4 layers: use_more_bits holds for 2 and 3 only
    assert ty("blk.2.attn_v.weight", "Q5_K_M") == T.Q6_K and ty("blk.1.attn_v.weight", "Q5_K_M") == T.Q5_K
    assert ty("token_embd.weight", "Q5_K_M") == T.Q5_K   # untied: the base type
    assert ty("blk.0.attn_q.bias", "Q4_K_M") == T.F32
    assert ty("blk.0.attn_q.weight", "F16") == T.F16 and ty("output_norm.weight", "F16") == T.F32
    # a row of 768 is three Q4_K blocks; a row of 96 is not one: Q4_K -> Q5_0, Q6_K -> Q8_0
    odd = ModelShape("odd", "llama", "llama", hidden=96, layers=1, heads=2, kv_heads=1,
                     head_dim=48, ffn=64, tied=False, rope_theta=1e4, rms_eps=1e-5, context=64)
    o = {t.gguf_name: t for t in tensors(odd)}
    assert tensor_type(o["blk.0.attn_q.weight"], FILE_TYPES["Q4_K_M"], 1, False) == T.Q5_0
    assert tensor_type(o["output.weight"], FILE_TYPES["Q4_K_M"], 1, False) == T.Q8_0


def test_gguf_round_trips_through_reader_and_transformers(tiny_q4_k_m):
    from transformers import AutoConfig

    path, _ = tiny_q4_k_m
    reader = GGUFReader(path)
    shapes = {t.name: tuple(int(x) for x in t.shape[::-1]) for t in reader.tensors}
    assert shapes == {t.gguf_name: t.shape for t in tensors(TINY)}
    # the scale fields keep every dequantized weight finite and of modest size
    for t in reader.tensors:
        if t.tensor_type in (T.Q4_K, T.Q6_K):
            w = dequantize(t.data, t.tensor_type)
            assert np.isfinite(w).all() and np.abs(w).max() < 10, t.name
    rope = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    np.testing.assert_allclose(rope.data, llama3_rope_factors(TINY), rtol=1e-6)
    assert reader.fields["tokenizer.ggml.tokens"].data and len(
        reader.fields["tokenizer.ggml.tokens"].data) == 49152
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim,
            cfg.max_position_embeddings, cfg.tie_word_embeddings) == \
        ("llama", 256, 8, 4, 2, 512, 49152, 64, 2048, True)


def test_qwen2_gguf_config(tmp_path):
    from transformers import AutoConfig

    path = tmp_path / "q.gguf"
    write_gguf(path, TINY_QWEN, FILE_TYPES["Q8_0"], tokenizer_gguf=default_model_path())
    cfg = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads,
            cfg.tie_word_embeddings) == ("qwen2", 256, 768, 2, False)
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    names = {t.name for t in GGUFReader(path).tensors}
    assert {"blk.3.attn_q.bias", "blk.3.attn_k.bias", "blk.3.attn_v.bias", "output.weight"} <= names


def test_bf16_folder_loads_in_transformers(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    files = write_hf_folder(tmp_path, TINY_QWEN, seed=3, tokenizer_gguf=default_model_path())
    assert [f.name for f in files] == ["model.safetensors"]
    cfg = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("qwen2", 256, 4)
    with safe_open(files[0], "pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert names == {t.hf_name for t in tensors(TINY_QWEN) if t.hf_name}
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (256, 768)
    assert 0.8 < float(w.float().std()) * 768 ** 0.5 < 1.2
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (tmp_path / "tokenizer.json").is_file()


def test_cli_lists_and_refuses_unknown(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SHAPES) and "SmolLM2-135M-Instruct" in out
    with pytest.raises(SystemExit, match="unknown shape"):
        main(["--shape", "llama-9b", "--out", "/nonexistent"])


def test_default_out_follows_the_cache_dir(monkeypatch, tmp_path):
    """Without --out, files go to $CONVEYOR_CACHE_DIR/models, beside our other caches."""
    from service.bench.make_models import default_out

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    assert default_out() == tmp_path / "cache" / "models"
    monkeypatch.delenv("CONVEYOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_out() == tmp_path / "xdg" / "conveyor" / "models"


def test_estimated_bytes_is_the_data(tiny_q4_k_m, monkeypatch):
    from service.bench import make_models

    path, _ = tiny_q4_k_m
    monkeypatch.setitem(make_models.SHAPES, "tiny", TINY)
    data = make_models.estimated_bytes("tiny", "Q4_K_M")
    # the rest is the header: metadata with SmolLM2's tokenizer (about 1.5 MB), the tensor
    # table and alignment padding
    assert data < path.stat().st_size < data + 4_000_000


def _llama_server():
    from service.bench.llama_server import find_llama_server

    return find_llama_server()


@pytest.mark.skipif(_llama_server() is None,
                    reason="no llama-server binary: scripts/build_llama_server builds one "
                           "(or set CONVEYOR_LLAMA_SERVER)")
@pytest.mark.parametrize("shape,ftype", [(TINY, "Q4_K_M"), (TINY_QWEN, "Q4_0")],
                         ids=["llama-Q4_K_M", "qwen2-Q4_0"])
def test_llama_server_serves_the_files(shape, ftype, tmp_path):
    """llama.cpp loads the metadata, tokenizer, tensor types (rope_freqs, qkv biases
    included) and serves a completion from the random weights."""
    from service.bench.llama_build import check_server

    path = tmp_path / f"{shape.name}-{ftype}.gguf"
    write_gguf(path, shape, FILE_TYPES[ftype], tokenizer_gguf=default_model_path())
    result = check_server(_llama_server(), path, threads=1)
    assert result.ok, result.detail
