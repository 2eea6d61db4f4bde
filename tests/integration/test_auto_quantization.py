"""--quantization auto (the default) on the real model: the default GGUF's own blocks (Q4_1
layers, a Q8_0 LM head / embedding) served as they are, equal to transformers' dequantized
fp32 weights bit for bit per layer, and the model's answers the fp32 oracle's."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from kernels.quant_pack import unpack
from service.bench.int8_accuracy import all_logits, greedy, make_runner
from service.worker.gguf_weights import read_linear_weights
from service.worker.loader import default_model_path
from service.worker.quantization.plan import DispatchLinear
from tests.integration.test_int8 import PROMPTS, TEXT

pytestmark = pytest.mark.skipif(not qlc.available_isas(), reason="needs our C++ kernels")


def _hf_weight(weights: dict, layer: int | None, cls: str) -> torch.Tensor:
    if layer is None:
        return weights["lm_head.weight"]
    p = f"model.layers.{layer}."
    names = {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
             "o": [p + "self_attn.o_proj.weight"],
             "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
             "down": [p + "mlp.down_proj.weight"]}[cls]
    return torch.cat([weights[n] for n in names])


def test_default_gguf_blocks_are_transformers_weights_bit_for_bit(loaded_model) -> None:
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(default_model_path()).tensors}
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types  # tied head
    assert {types[f"blk.{i}.{n}.weight"] for i in range(30)
            for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                      "ffn_down")} == {"Q4_1"}
    cfg = loaded_model.hf_config
    got = read_linear_weights(default_model_path(), cfg.num_hidden_layers,
                              cfg.num_attention_heads, cfg.num_key_value_heads)
    assert len(got.native) == 4 * cfg.num_hidden_layers + 1 and not got.dequantized
    isa = qlc.available_isas()[0]
    for (layer, cls), blocks in got.native.items():
        assert blocks.fmt == ("q8_0" if cls == "lm_head" else "q4_1")
        packed = blocks.pack()
        want = _hf_weight(loaded_model.weights, layer, cls)
        assert torch.equal(unpack(packed), want), (layer, cls)
        assert torch.equal(qlc.dequantize(packed, isa), want), (layer, cls)


@pytest.fixture(scope="module")
def runners(loaded_model):
    return make_runner(loaded_model, None, 256), make_runner(loaded_model, "auto", 256)


def test_auto_serves_the_files_formats_and_the_oracles_answers(runners, tokenizer) -> None:
    fp32, auto = runners
    plan = auto.linear_plan
    assert auto.model.quantization == "auto" and plan is not None and plan.natives == {}
    for lin, fmt in [(l.gate_up, "q4_1") for l in auto.model.layers] + \
            [(auto.model.lm_head, "q8_0")]:
        one_row = lin.fns[0] if isinstance(lin, DispatchLinear) else lin
        # decode reads the file's own blocks, with fp32 or int16 activations (unless fp32 of
        # the same weights measured faster)
        assert getattr(getattr(one_row, "packed", None), "fmt", fmt) in (fmt, f"{fmt}x16", "f32")
    a, b = all_logits(fp32, tokenizer.encode(TEXT)), all_logits(auto, tokenizer.encode(TEXT))
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    # the same weights: summation order only
    assert float(cosine.min()) > 0.999 and float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.95
    chosen = {n for names in plan.choices.values() for n in names}
    # never bf16 on the file's layers, even where it is the fastest (AVX512-BF16, AMX): it
    # would round their blocks, and on a Zen 4 it took argmax agreement on TEXT down to 0.939
    assert "bf16" not in chosen
    if not any("x16-" in n for n in chosen):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)  # summation order only
    else:
        # int16 activations: 2^-16 of each group's largest |x|; with them on every layer at
        # 64 rows and on the LM head, measured max |diff| 0.0086 on logits up to 35 (AVX2)
        torch.testing.assert_close(b, a, atol=3e-2, rtol=1e-3)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    same = sum(x == y for x, y in zip(greedy(fp32, prompts, 8), greedy(auto, prompts, 8)))
    assert same >= len(prompts) - 1


def test_decode_buckets_read_their_weights_from_huge_page_arenas(runners) -> None:
    # service/worker/weight_pages.py: the runner moved the 1-31-row paths' packed weights into
    # one arena; a GGUF file's blocks are packed straight into arenas of their own and stay
    import torch

    from service.worker.huge_pages import advise_huge_pages, on_huge_pages
    from service.worker.quantization.paths import CppLinear

    _, auto = runners
    packed = [fn.packed for lin in auto.model.linears()
              for fn in (lin.fns[:2] if isinstance(lin, DispatchLinear) else [lin])
              if isinstance(fn, CppLinear)]
    assert len(packed) >= 121  # every layer and the LM head run a C++ kernel at one row
    tensors = [t for p in packed for t in (p.data, p.scale, p.minv, p.bias, p.super_scale,
                                           p.super_min) if t is not None]
    arenas = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(arenas) <= len({id(p.data) for p in packed})  # one per weight at most
    if advise_huge_pages(torch.empty(4 << 20, dtype=torch.uint8)):  # the advice is taken here
        assert all(on_huge_pages(t) for t in tensors)
