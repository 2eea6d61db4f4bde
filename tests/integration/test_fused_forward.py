"""The fused CPU forward (one native call a step) on the real model: the same logits, K/V
and greedy tokens as the unfused forward over the same linear kernels, and bad input
refused before the cache is touched."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_forward_cpu as dfc
from kernels import quant_linear_cpu as qlc
from service.bench.int8_accuracy import greedy, make_runner
from service.core.scheduler_output import SchedulerOutput
from service.worker.quantization.plan import BUCKETS
from tests.integration.decode_steps import both_forwards, prefill

pytestmark = [pytest.mark.model, pytest.mark.skipif(
    not qlc.available_isas() or dfc.build_problem() is not None,
    reason="the fused forward needs the C++ kernels (g++)")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]


@pytest.fixture(scope="module")
def int4(loaded_model):
    runner = make_runner(loaded_model, "int4", 128)
    assert runner.model.fused, runner.fused_decode  # every int4 path is a C++ kernel
    return runner


def test_fused_decode_step_matches_unfused(int4, tokenizer) -> None:
    decodes = prefill(int4, [tokenizer.encode(p) for p in PROMPTS])
    _, unfused, kv_unfused, fused = both_forwards(int4, decodes, first_fused=False)
    assert fused.shape == unfused.shape == (3, int4.vocab_size)
    # Same linear kernels, the small ops in C++ instead of torch: rounding-level differences.
    assert torch.allclose(fused, unfused, rtol=1e-4, atol=1e-4), (fused - unfused).abs().max()
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))
    # The K/V this step wrote in every layer (the rest of the cache is untouched by both).
    for layer, (a, b) in enumerate(zip(int4.kv_caches, kv_unfused)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-4, (layer, err)


def test_fused_greedy_equals_unfused(loaded_model, int4, tokenizer) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    fused = greedy(int4, prompts, 12)
    saved, int4.model.fused = int4.model.fused, {}
    try:
        unfused = greedy(int4, prompts, 12)
    finally:
        int4.model.fused = saved
    assert fused == unfused


def test_fused_refuses_bad_rows_before_writing(int4, tokenizer) -> None:
    decodes = prefill(int4, [tokenizer.encode(PROMPTS[0])])
    ids, pos, meta, last = int4.prepare_inputs(SchedulerOutput(decodes, 1))
    fused = int4.model.fused[0]
    kd = meta.plan.kernel_decodes
    before = [kv.clone() for kv in int4.kv_caches]
    bad_slot = torch.tensor([int4.num_blocks * int4.block_size])
    with pytest.raises(ValueError, match="slot"):
        fused(ids, pos, bad_slot, kd.block_tables, kd.seq_lens, last)
    with pytest.raises(ValueError, match="token id or position"):
        fused(torch.tensor([int4.vocab_size]), pos, meta.slot_mapping, kd.block_tables,
              kd.seq_lens, last)
    with pytest.raises(ValueError, match="int64"):
        fused(ids.int(), pos, meta.slot_mapping, kd.block_tables, kd.seq_lens, last)
    assert all(torch.equal(a, b) for a, b in zip(int4.kv_caches, before))


def test_dense_fp32_is_not_fused_and_on_says_why(loaded_model) -> None:
    dense = make_runner(loaded_model, None, 16)
    assert dense.model.fused == {} and dense.fused_decode.startswith("off (")
    from service.worker.fused_forward import build_fused_forward

    with pytest.raises(ValueError, match="--cpu-fused-decode on"):
        build_fused_forward(dense.model, dense.kv_caches, "on", dense.decode_kernel)


def test_batch_invariant_fuses_every_bucket(loaded_model) -> None:
    inv = make_runner(loaded_model, None, 16, batch_invariant=True)
    assert sorted(inv.model.fused) == list(range(len(BUCKETS)))
