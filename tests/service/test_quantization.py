"""service.worker.quantization: per-channel weights, int8 linear layers, SmoothQuant factors,
calibration data; the --quantization setting (config and CLI)."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from service.engine_args import add_engine_args, engine_config
from service.config import ModelConfig
from service.worker.quantization.isa import int8_isa
from service.worker.quantization import (AmaxObserver, DenseLinear, Int8Linear,
                                         calibration_token_ids,
                                         quantize_per_channel, smoothing_factors)

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                reason="int8 needs torch's fbgemm engine (x86-64)")


def _weight(out: int = 48, inp: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-channel scales must follow each row
    return torch.randn(out, inp, generator=g) * torch.logspace(-2, 1, out)[:, None]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def test_quantize_per_channel_scales_range_and_error() -> None:
    w = _weight()
    w[3] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    expected = w.abs().amax(1) / 127
    expected[3] = 1.0  # an all-zero row
    torch.testing.assert_close(scale, expected)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[3], torch.zeros(32, dtype=torch.int8))
    # every entry within half a step of its row's scale
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, dtype=torch.int32),
                                 torch.tensor([[1.0, float("nan")]])])
def test_quantize_per_channel_rejects_bad_weights(bad) -> None:
    with pytest.raises(ValueError):
        quantize_per_channel(bad)


# reduce_range: None is what this machine uses (7-bit activations without VNNI); True (7 bits)
# is valid on every x86-64 CPU; False (8 bits) only with VNNI: without it fbgemm's int16
# accumulation saturates (relative error 0.07-0.18 measured on an AVX2-only Zen 3).
REDUCE_RANGES = [None, True, pytest.param(False, marks=pytest.mark.skipif(
    int8_isa().reduce_range, reason="8-bit activations saturate fbgemm without VNNI"))]


@pytest.mark.parametrize("reduce_range", REDUCE_RANGES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_close_to_fp32(per_token, rows, reduce_range) -> None:
    w = _weight(96, 64)
    b = torch.randn(96)
    lin = Int8Linear(w, b, per_token=per_token, reduce_range=reduce_range)
    assert lin.reduce_range == (int8_isa().reduce_range if reduce_range is None else reduce_range)
    assert (lin.in_features, lin.out_features) == (64, 96)
    assert lin.qweight.shape == (96, 64) and lin.scale.shape == (96,)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    y = lin(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    # close to the fp32 product, and closer still to the product with the int8 weight
    assert _rel_err(y, F.linear(x, w, b)) < 0.03
    assert _rel_err(y, F.linear(x, lin.dequantized(), b)) < 0.02


def test_per_token_scales_rows_apart() -> None:
    # one row with a huge activation: per tensor it flattens every other row to a few
    # levels, per token each row keeps its own resolution
    w = _weight(64, 64)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    x[0] *= 1000.0
    ref = F.linear(x[1:], w)
    per_tensor = Int8Linear(w)(x)[1:]  # this machine's reduce_range
    per_token = Int8Linear(w, per_token=True)(x)[1:]
    assert _rel_err(per_token, ref) < 0.03
    assert _rel_err(per_token, ref) * 10 < _rel_err(per_tensor, ref)


def test_int8_linear_accepts_strided_rows_and_restores_the_engine() -> None:
    before = torch.backends.quantized.engine
    lin = Int8Linear(_weight(32, 32), per_token=True)
    assert torch.backends.quantized.engine == before
    wide = torch.randn(5, 48)
    x = wide[:, :32]  # rows 48 apart, as a slice of a fused projection
    torch.testing.assert_close(lin(x), lin(x.contiguous()))


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="bias"):
        Int8Linear(torch.randn(4, 3), torch.randn(5))
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        DenseLinear(torch.randn(4))


def test_dense_linear_is_f_linear() -> None:
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    assert torch.equal(DenseLinear(w, b)(x), F.linear(x, w, b))


def test_amax_observer_keeps_channel_maxima_and_passes_through() -> None:
    inner = DenseLinear(torch.eye(3))
    obs = AmaxObserver(inner)
    assert obs.amax is None
    out = obs(torch.tensor([[1.0, -5.0, 0.0]]))
    assert torch.equal(out, torch.tensor([[1.0, -5.0, 0.0]]))
    obs(torch.tensor([[-2.0, 1.0, 0.5], [0.0, 0.0, -0.25]]))
    obs(torch.zeros(0, 3))  # an empty batch changes nothing
    assert obs.amax.tolist() == [2.0, 5.0, 0.5]


def test_smoothing_factors_balance_and_keep_the_product() -> None:
    act = torch.tensor([100.0, 1.0, 0.0, 4.0])
    wmax = torch.tensor([1.0, 1.0, 3.0, 0.0])
    s = smoothing_factors(act, wmax, alpha=0.5)
    # sqrt(100 / 1) = 10, sqrt(1 / 1) = 1, no activation or no weight -> 1
    torch.testing.assert_close(s, torch.tensor([10.0, 1.0, 1.0, 1.0]))
    assert torch.equal(smoothing_factors(act[:2], wmax[:2], alpha=0.0),
                       torch.tensor([1.0, 1.0]))
    # folding: (x / s) @ (W * s)^T == x @ W^T
    w = _weight(8, 4)
    x = torch.randn(3, 4) * torch.tensor([100.0, 1.0, 1.0, 4.0])
    s = smoothing_factors(x.abs().amax(0), w.abs().amax(0))
    torch.testing.assert_close(F.linear(x / s, w * s), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="alpha"):
        smoothing_factors(act, wmax, alpha=1.5)
    with pytest.raises(ValueError, match="shape"):
        smoothing_factors(act, wmax[:3])


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The default model's tokenizer alone (no weights)."""
    from transformers import AutoTokenizer

    from service.worker.loader import _source, default_model_path

    folder, kw = _source(default_model_path())
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)


def test_calibration_tokens_use_the_chat_template(smollm_tokenizer) -> None:
    tokenizer = smollm_tokenizer
    ids = calibration_token_ids(tokenizer)
    assert len(ids) > 300
    text = tokenizer.decode(ids)
    assert "<|im_start|>" in text and "moving_average" in text


def test_quantization_setting_is_validated_and_parsed() -> None:
    assert ModelConfig().quantization == "auto"  # the checkpoint's own weights
    assert ModelConfig(quantization=None).quantization is None  # the fp32 oracle
    assert ModelConfig(quantization="auto", dtype="bfloat16").quantization == "auto"  # = none
    assert ModelConfig(quantization="int8").quantization == "int8"
    assert ModelConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int8", device="cuda")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).model.quantization == "auto"
    assert engine_config(p.parse_args(["--quantization", "none"])).model.quantization is None
    assert engine_config(p.parse_args(["--quantization", "int8"])).model.quantization == "int8"
    assert engine_config(p.parse_args(["--quantization", "int4"])).model.quantization == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "fp8"])


def test_batch_invariant_setting_is_validated_and_parsed() -> None:
    assert not ModelConfig().batch_invariant
    assert ModelConfig(batch_invariant=True, quantization="int4").batch_invariant
    for bad in ({"dtype": "bfloat16"}, {"device": "cuda"}, {"cpu_decode_kernel": "sdpa"},
                {"attention_backend": "triton"}):
        with pytest.raises(ValueError, match="batch_invariant"):
            ModelConfig(batch_invariant=True, **bad)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert not engine_config(p.parse_args([])).model.batch_invariant
    assert engine_config(p.parse_args(["--batch-invariant"])).model.batch_invariant


def test_clones_compute_the_same_on_other_memory() -> None:
    # kernel timing streams clones of a layer from DRAM: each must equal its original
    from service.worker.quantization.paths import PATHS, LayerWeights

    w, b = _weight(64, 32), torch.randn(64)
    x = torch.randn(5, 32)
    from service.worker.gguf_weights import BlockWeight, RawBlocks
    from tests.kernels.test_gguf_pack import random_raw
    q = torch.randint(0, 16, (64, 32), dtype=torch.uint8)
    blocks = {"q4_1": BlockWeight(("Q4_1",), "q4_1", q, torch.rand(64, 1).half(),
                                  -torch.rand(64, 1).half()),
              "q8_0": BlockWeight(("Q8_0",), "q8_0", q.to(torch.int8) - 8,
                                  torch.rand(64, 1).half(), None),
              "q4_0": RawBlocks(("Q4_0",), (random_raw("Q4_0", 64, 32).numpy(),), 32),
              "q4_k": RawBlocks(("Q4_K",), (random_raw("Q4_K", 64, 256).numpy(),), 256),
              "q5_k": RawBlocks(("Q5_K",), (random_raw("Q5_K", 64, 256).numpy(),), 256),
              "i8_k": RawBlocks(("Q2_K", "Q3_K"), (random_raw("Q2_K", 32, 256).numpy(),
                                                    random_raw("Q3_K", 32, 256).numpy()), 256),
              "split": RawBlocks(("Q4_K", "Q6_K"), (random_raw("Q4_K", 32, 256).numpy(),
                                                     random_raw("Q6_K", 32, 256).numpy()), 256),
              "q6_k": RawBlocks(("Q6_K",), (random_raw("Q6_K", 64, 256).numpy(),), 256)}
    for name, path in PATHS.items():
        if path.problem() is not None:
            continue
        lw = LayerWeights(w, b) if path.native is None else \
            LayerWeights(blocks[path.native].dequantize(), b, native=blocks[path.native])
        lin = path.bind(lw)
        twin = lin.clone()
        xk = x if lw.shape[1] == x.shape[1] else torch.randn(5, lw.shape[1])  # K-quants: 256
        assert torch.equal(twin(xk), lin(xk)), name
        for attr in ("weight", "qweight", "packed"):
            if hasattr(lin, attr):
                a, c = getattr(lin, attr), getattr(twin, attr)
                if attr == "packed":  # a split weight: its first part's
                    a, c = (getattr(a, "parts", (a,))[0].data, getattr(c, "parts", (c,))[0].data)
                assert a.data_ptr() != c.data_ptr(), name
