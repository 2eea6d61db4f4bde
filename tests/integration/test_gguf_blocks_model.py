"""The default GGUF served from its own blocks (``load_model(..., blocks=True)``, what
``conveyor serve`` runs in the default --quantization auto): no dense copy of the model, the
weights transformers' dequantized ones bit for bit, and the answers the fp32 oracle's."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_linear_cpu as qlc
from service.bench.int8_accuracy import all_logits, greedy, make_runner
from service.worker.quantization.linear import DenseLinear, PendingLinear
from service.worker.quantization.plan import DispatchLinear
from tests.integration.test_auto_quantization import _hf_weight
from tests.integration.test_int8 import PROMPTS, TEXT

pytestmark = pytest.mark.skipif(not qlc.available_isas(), reason="needs our C++ kernels")


def test_blocks_are_transformers_weights(served_model, loaded_model) -> None:
    assert served_model.blocks_only and not loaded_model.blocks_only
    # only norms (and biases, none here) are dense; every linear layer is blocks
    assert all(n.endswith("norm.weight") for n in served_model.weights)
    for name, w in served_model.weights.items():
        assert torch.equal(w, loaded_model.weights[name]), name
    layers = served_model.gguf_linear.layers
    cfg = served_model.hf_config
    for key in [(0, "qkv"), (cfg.num_hidden_layers - 1, "down"), (3, "gate_up"), (None, "lm_head")]:
        want = _hf_weight(loaded_model.weights, *key) if key[0] is not None else \
            loaded_model.weights["model.embed_tokens.weight"]  # tied
        assert torch.equal(layers[key].dequantize(), want), key
    ids = torch.tensor([0, 1, 17, 49151, 17])
    assert torch.equal(served_model.embedding(ids),
                       loaded_model.weights["model.embed_tokens.weight"][ids])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        served_model.embedding(torch.tensor([49152]))


@pytest.fixture(scope="module")
def runners(served_model, loaded_model):
    # the exact paths over the blocks: where the CPU computes bf16 in hardware, the choice may
    # give the 181+-row bucket to bf16 and its gate may keep it (test_bf16_compute's subject)
    return (make_runner(loaded_model, None, 256),
            make_runner(served_model, "auto", 256, cpu_bf16_compute="off"))


def test_served_from_blocks_answers_as_the_oracle(runners, tokenizer) -> None:
    fp32, auto = runners
    model = auto.model
    assert model.embed is None and model.block_embed is not None
    for lin in model.linears():  # every layer on a kernel over its blocks, none dense
        fns = lin.fns if isinstance(lin, DispatchLinear) else [lin]
        assert not any(isinstance(f, (DenseLinear, PendingLinear)) for f in fns)
        assert all(getattr(f, "packed", None) is not None and f.packed.fmt != "f32"
                   for f in fns)
    a, b = all_logits(fp32, tokenizer.encode(TEXT)), all_logits(auto, tokenizer.encode(TEXT))
    # int16 activations where chosen: within 3e-2 on logits up to 35 (test_auto_quantization)
    torch.testing.assert_close(b, a, atol=3e-2, rtol=1e-3)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    same = sum(x == y for x, y in zip(greedy(fp32, prompts, 8), greedy(auto, prompts, 8)))
    assert same >= len(prompts) - 1


def test_fused_decode_looks_up_rows_from_blocks(runners, tokenizer) -> None:
    _, auto = runners
    if not auto.model.fused:
        pytest.skip(f"no fused forward here: {auto.fused_decode}")
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    fused = greedy(auto, prompts, 6)
    kept, auto.model.fused = auto.model.fused, {}
    try:
        unfused = greedy(auto, prompts, 6)
    finally:
        auto.model.fused = kept
    assert fused == unfused


def test_a_model_of_blocks_needs_the_auto_mode(served_model) -> None:
    with pytest.raises(ValueError, match="served in quantization auto"):
        make_runner(served_model, "int8", 64)


def test_batch_invariant_mode_serves_the_blocks_row_invariantly(served_model, tokenizer) -> None:
    runner = make_runner(served_model, "auto", 256, batch_invariant=True)
    assert all(n.startswith("cpp-") and "x16" not in n and "x8" not in n
               for names in runner.linear_plan.choices.values() for n in names)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    alone = [greedy(runner, [p], 6)[0] for p in prompts]
    assert greedy(runner, prompts, 6) == alone
