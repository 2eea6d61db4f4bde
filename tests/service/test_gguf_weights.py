"""service.worker.gguf_weights on a small GGUF file written here (gguf's own writer and
quantizers): Q4_0, Q4_1 and Q8_0 blocks read raw give gguf-py's (ggml's) dequantized
weights bit for bit, packed for our kernels too; Q / K rows un-permuted as transformers
does; a block type we cannot reproduce is reported, not served."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kernels.packed_parts import PackedParts, unpack_any  # noqa: E402
from kernels.quant_pack import unpack  # noqa: E402
from service.worker import gguf_weights as gw  # noqa: E402

T = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, FFN = 4, 2, 64, 96  # head dim 16


def _write(path, types: dict[str, T]) -> dict[str, np.ndarray]:
    """One decoder layer and a tied embedding, each tensor of `types` (default Q4_1);
    returns each tensor's dequantized weight as gguf-py computes it ([out, in])."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (40, HIDDEN), "blk.0.attn_q": (HIDDEN, HIDDEN),
              "blk.0.attn_k": (KV_HEADS * 16, HIDDEN), "blk.0.attn_v": (KV_HEADS * 16, HIDDEN),
              "blk.0.attn_output": (HIDDEN, HIDDEN), "blk.0.ffn_gate": (FFN, HIDDEN),
              "blk.0.ffn_up": (FFN, HIDDEN), "blk.0.ffn_down": (HIDDEN, FFN)}
    w = gguf.GGUFWriter(str(path), "llama")
    want = {}
    for name, shape in shapes.items():
        qtype = types.get(name, T.Q4_1)
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(f"{name}.weight", q, raw_dtype=qtype)
        want[name] = gguf.quants.dequantize(q, qtype).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def _permuted_back(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_blocks_are_gguf_py_dequantized_weights_bit_for_bit(tmp_path, qtype) -> None:
    want = _write(tmp_path / "m.gguf", {n: qtype for n in ("blk.0.attn_output", "blk.0.ffn_down",
                                                         "token_embd")})
    got = gw.read_linear_weights(str(tmp_path / "m.gguf"), 1, HEADS, KV_HEADS)
    fmt = qtype.name.lower()
    for key, name in [((0, "o"), "blk.0.attn_output"), ((0, "down"), "blk.0.ffn_down"),
                      ((None, "lm_head"), "token_embd")]:
        blocks = got.native[key]
        assert blocks.fmt == fmt and blocks.gguf_types == (qtype.name,)
        ref = torch.from_numpy(want[name])
        assert torch.equal(blocks.dequantize(), ref)
        packed = blocks.pack()
        assert torch.equal(unpack(packed), ref)  # what the kernel multiplies by
        assert packed.scale.dtype == torch.float16
        assert (packed.minv is None) == (qtype != T.Q4_1)  # q4_0: the kernel forms -8 d
    if qtype == T.Q4_0:  # the decoded form: q4_1's with min = -8 d, exact in fp16
        b = got.native[(0, "o")].decoded()
        assert torch.equal(b.m, -8 * b.d)


def test_fused_qkv_and_gate_up_rows_in_transformers_order(tmp_path) -> None:
    want = _write(tmp_path / "m.gguf", {})
    got = gw.read_linear_weights(str(tmp_path / "m.gguf"), 1, HEADS, KV_HEADS)
    qkv = torch.from_numpy(np.concatenate([_permuted_back(want["blk.0.attn_q"], HEADS),
                                           _permuted_back(want["blk.0.attn_k"], KV_HEADS),
                                           want["blk.0.attn_v"]]))
    assert torch.equal(got.native[(0, "qkv")].dequantize(), qkv)
    assert got.native[(0, "qkv")].gguf_types == ("Q4_1",) * 3
    gate_up = torch.from_numpy(np.concatenate([want["blk.0.ffn_gate"], want["blk.0.ffn_up"]]))
    assert torch.equal(got.native[(0, "gate_up")].dequantize(), gate_up)
    assert not got.dequantized


def test_types_without_a_kernel_are_served_dequantized_and_mixes_split(tmp_path) -> None:
    _write(tmp_path / "m.gguf", {"blk.0.ffn_down": T.F16, "blk.0.attn_v": T.Q8_0,
                                 "blk.0.ffn_up": T.Q5_0, "blk.0.attn_output": T.Q5_1})
    got = gw.read_linear_weights(str(tmp_path / "m.gguf"), 1, HEADS, KV_HEADS)
    # F16: fp32 holds it exactly, served as a dense layer and not reported as lost
    assert got.dequantized[(0, "down")] == ("F16",)
    assert got.dequantized_types() == {}
    # a Q4_1 / Q8_0 mix and a Q4_1 / Q5_0 mix: each part in its own format (q4_1 then
    # q8_0), still exact
    for key in ((0, "qkv"), (0, "gate_up")):
        assert got.native[key].fmt == "split"
        packed = got.native[key].pack()
        assert isinstance(packed, PackedParts)
        assert [p.fmt for p in packed.parts] == ["q4_1", "q8_0"]
        assert torch.equal(unpack_any(packed), got.native[key].dequantize())
    # Q5_1 has no format of its own but 8-bit K-style blocks
    assert got.native[(0, "o")].fmt == "i8_k"
    assert torch.equal(unpack(got.native[(0, "o")].pack()), got.native[(0, "o")].dequantize())


def test_layer_weight_from_blocks_is_gguf_py_s_dequantization(tmp_path) -> None:
    # LayerWeights.weight (what the bf16 copy and the checks start from) dequantizes a layer
    # with blocks through our C++ kernel where it builds: the same bits as gguf-py's numpy,
    # for a single format, a split mix and an 8-bit K-style one
    from service.worker.quantization.paths import LayerWeights

    _write(tmp_path / "m.gguf", {"blk.0.attn_v": T.Q8_0, "blk.0.attn_output": T.Q5_1,
                                 "blk.0.ffn_down": T.Q4_0})
    got = gw.read_linear_weights(str(tmp_path / "m.gguf"), 1, HEADS, KV_HEADS)
    for key in ((0, "qkv"), (0, "o"), (0, "down"), (0, "gate_up")):
        blocks = got.native[key]
        assert torch.equal(LayerWeights(None, None, native=blocks).weight, blocks.dequantize())
