"""--quantization int8 on the real model: close to fp32 (the oracle), and fp32 untouched.

Thresholds sit well under what was measured (see the comments) so that they catch a
broken int8 path (e.g. no smoothing: teacher-forced agreement fell to about 65%), not
noise. The full accuracy figures: `python -m service.bench.int8_accuracy`.
"""

from __future__ import annotations

import pytest
import torch

from service.bench.int8_accuracy import all_logits, greedy, leading_agreement, make_runner
from service.worker.quantization import Int8Linear
from tests.integration.greedy_prompts import GREEDY_PROMPTS

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                reason="int8 needs torch's fbgemm engine (x86-64)")

PROMPTS = [*GREEDY_PROMPTS, "The three states of matter are"]
TEXT = ("Bread begins with four ingredients and a great deal of patience. Flour and water, "
        "left to rest together, form gluten: long elastic proteins that trap the gas made by "
        "yeast as it eats the sugars in the dough. A baker folds the dough rather than "
        "kneading it hard, stretching the strands and letting them relax again.")


@pytest.fixture(scope="module")
def runners(loaded_model):
    return make_runner(loaded_model, None, 256), make_runner(loaded_model, "int8", 256)


def test_int8_model_is_quantized_and_fp32_is_untouched(loaded_model, runners, tokenizer) -> None:
    fp32, int8 = runners
    model = int8.model
    assert model.quantization == "int8" and fp32.model.quantization is None
    for layer in model.layers:
        assert all(isinstance(lin, Int8Linear) for lin in (layer.qkv, layer.o, layer.gate_up,
                                                           layer.down))
        assert layer.down.per_token and not layer.qkv.per_token
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.per_token
    # smoothing changed the int8 model's norm weights, never the shared checkpoint
    assert not torch.equal(model.layers[3].ln1_w, fp32.model.layers[3].ln1_w)
    assert torch.equal(fp32.model.layers[3].ln1_w,
                       loaded_model.weights["model.layers.3.input_layernorm.weight"])
    # a fresh fp32 runner built after the int8 one gives bit-identical logits
    ids = tokenizer.encode(TEXT)
    again = make_runner(loaded_model, None, 64)
    assert torch.equal(all_logits(fp32, ids), all_logits(again, ids))


def test_int8_logits_close_to_fp32(runners, tokenizer) -> None:
    fp32, int8 = runners
    ids = tokenizer.encode(TEXT)
    a, b = all_logits(fp32, ids), all_logits(int8, ids)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    # measured: mean 0.997, min 0.974 (66 tokens)
    assert float(cosine.mean()) > 0.99
    assert float(cosine.min()) > 0.9
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert agree > 0.75  # measured 0.88


def test_int8_greedy_agrees_with_fp32_on_the_first_tokens(runners, tokenizer) -> None:
    fp32, int8 = runners
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ref = greedy(fp32, prompts, 8)
    got = greedy(int8, prompts, 8)
    assert all(len(g) == 8 for g in got)
    lead = [leading_agreement(r, g) for r, g in zip(ref, got)]
    # measured: leading agreement [8, 8, 8, 8, 8, 8] (all six continuations identical)
    assert sum(n >= 3 for n in lead) >= 4, lead
    assert sum(lead) >= 24, lead
