"""--quantization int8 / int4 on the real model: close to fp32 (the oracle), fp32 untouched,
every linear served as the machine's measured plan says, and every path forced in turn.

Thresholds sit well under what was measured (see the comments) so that they catch a
broken int8 path (e.g. no smoothing: teacher-forced agreement fell to about 65%), not
noise. The full accuracy figures: `python -m service.bench.int8_accuracy`.
"""

from __future__ import annotations

import pytest
import torch

from service.bench.int8_accuracy import all_logits, greedy, leading_agreement, make_runner
from service.worker.quantization import DenseLinear
from service.worker.quantization.choice import FUSION_SLACK
from service.worker.quantization.plan import BUCKETS, DispatchLinear
from tests.integration.greedy_prompts import GREEDY_PROMPTS

CLASSES = ("qkv", "o", "gate_up", "down", "lm_head")

PROMPTS = [*GREEDY_PROMPTS, "The three states of matter are"]
TEXT = ("Bread begins with four ingredients and a great deal of patience. Flour and water, "
        "left to rest together, form gluten: long elastic proteins that trap the gas made by "
        "yeast as it eats the sugars in the dough. A baker folds the dough rather than "
        "kneading it hard, stretching the strands and letting them relax again.")


@pytest.fixture(scope="module")
def runners(loaded_model):
    return make_runner(loaded_model, None, 256), make_runner(loaded_model, "int8", 256)


def _check_follows_plan(model, plan) -> None:
    for lin, cls in [(getattr(layer, c), c) for layer in model.layers for c in CLASSES[:4]] + \
            [(model.lm_head, "lm_head")]:
        names = plan.choices[cls]
        if len(set(names)) > 1:
            assert isinstance(lin, DispatchLinear) and lin.names == names
        elif names[0] == "fp32":
            assert isinstance(lin, DenseLinear)
        else:
            assert not isinstance(lin, (DenseLinear, DispatchLinear))


def test_int8_model_follows_its_plan_and_fp32_is_untouched(loaded_model, runners,
                                                          tokenizer) -> None:
    fp32, int8 = runners
    model, plan = int8.model, int8.linear_plan
    assert model.quantization == "int8" and fp32.model.quantization is None
    assert fp32.linear_plan is None and plan is not None and set(plan.choices) == set(CLASSES)
    _check_follows_plan(model, plan)
    # chosen by measurement: never slower than fp32 where fp32 was timed, but for a C++
    # path within FUSION_SLACK of it in the buckets the fused forward serves
    for cls in CLASSES:
        for b, row in enumerate(plan.timings_ms[cls]):
            if row:  # an untimed bucket (the LM head's 512) takes the bucket below's choice
                name = plan.choices[cls][b]
                fused = BUCKETS[b] <= plan.fused_rows and name.startswith("cpp-")
                slack = FUSION_SLACK if fused else 1.0
                assert row[name] <= slack * row.get("fp32", float("inf")), (cls, b, row)
    # smoothing changes the norm weights of the int8 model only, never the shared checkpoint
    if "qkv" in plan.smoothed_classes():
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
    # measured (AVX-512 VNNI, weight-only C++ int8 and int_mm): mean 0.9996, min 0.995, agree
    # 0.95 (66 tokens); before this plan (fbgemm per tensor, int_mm): 0.997, 0.974, 0.88
    assert float(cosine.mean()) > 0.99
    assert float(cosine.min()) > 0.9
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert agree > 0.75


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
