"""--quantization auto-a8 on the real model: the GGUF's own q4_1 / q8_0 blocks times int8
activations (the cpp-*x8 paths, forced here so that the test does not depend on which
path the timings pick). The fused forward runs them as the per-op forward does, and the
logits stay within int8 rounding of the fp32 oracle's."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_forward_cpu as dfc
from kernels import quant_linear_cpu as qlc
from service.bench.int8_accuracy import all_logits, make_runner
from service.worker.quantization.paths import PATHS
from tests.integration.decode_steps import both_forwards, prefill
from tests.integration.test_fused_forward import PROMPTS

pytestmark = [pytest.mark.model, pytest.mark.skipif(
    not qlc.available_isas() or dfc.build_problem() is not None,
    reason="the int8-activation paths need the C++ kernels (g++)")]

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted "
        "from those used to make wine. Books became cheaper, literacy spread across Europe, "
        "and ideas travelled faster than ever before.")


@pytest.fixture(scope="module")
def runners(loaded_model):
    x8 = ",".join(n for n in PATHS if "x8-" in n)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_LINEAR_PATHS", x8)
        a8 = make_runner(loaded_model, "auto-a8", 128)
    return a8, make_runner(loaded_model, None, 128)


def test_every_layer_serves_its_own_blocks_with_int8_activations(runners) -> None:
    a8, _ = runners
    formats = a8.linear_layer_formats()
    layers = len(a8.model.layers)
    assert formats == {"q4_1x8": 4 * layers, "q8_0x8": 1}, formats
    assert a8.model.fused, a8.fused_decode  # every path is a C++ kernel: decode fuses


def test_logits_stay_within_int8_rounding_of_the_oracle(runners, tokenizer) -> None:
    a8, fp32 = runners
    ids = tokenizer.encode(TEXT)
    got, want = all_logits(a8, ids), all_logits(fp32, ids)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    # measured on this text (AVX2 Zen 3): cosine mean 0.999, top-1 0.96
    assert float(cosine.mean()) > 0.995 and float(cosine.min()) > 0.95, cosine
    assert top1 > 0.85, top1


def test_fused_decode_step_is_the_per_op_one_up_to_activation_rounding(runners, tokenizer) -> None:
    """Fused and per-op forwards run the same x8 kernels, but their small ops (norms,
    rotary, SiLU) round differently, and an x one ulp apart may round to another int8: the
    logits agree to int8 rounding, not to fp32 rounding as with fp32 activations (so
    greedy text may part at a near-tie, as between any two kernels; --batch-invariant
    fuses every step and keeps one numerics)."""
    a8, _ = runners
    decodes = prefill(a8, [tokenizer.encode(p) for p in PROMPTS])
    _, unfused, _, fused = both_forwards(a8, decodes, first_fused=False)
    cosine = torch.nn.functional.cosine_similarity(fused, unfused, dim=-1)
    # measured (AVX2 Zen 3, 1 or 2 threads, every run): 0.9945, 0.9972, 0.9954. The decode
    # rows' inputs are the prompts' greedy tokens (prefill): with a sampled token, one
    # row once came out at 0.980.
    assert float(cosine.min()) > 0.99, cosine
