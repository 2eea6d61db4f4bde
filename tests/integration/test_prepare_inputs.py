"""The decode-only way of building a step's inputs (`step_inputs.prepare_decodes`) gives the
same tensors, attention plan included, as the general one, for both decode kernels."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from protocol import SamplingParams
from service.core.scheduler_output import ScheduledSequence
from service.worker.model_runner import ModelRunner
from service.worker.step_inputs import prepare_decodes, prepare_general

pytestmark = pytest.mark.model


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("decode_kernel", ["cpp", "sdpa"])
def test_decode_steps_build_the_same_inputs_both_ways(loaded_model, small_config,
                                                      decode_kernel) -> None:
    cfg = small_config(num_kv_blocks=256, quantization=None)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, cpu_decode_kernel=decode_kernel, cpu_fused_decode="off"))
    try:
        runner = ModelRunner(cfg, loaded_model)
    except ValueError as e:  # no compiler: the C++ decode kernel cannot run here
        pytest.skip(str(e))
    rng = random.Random(0)
    bs = runner.block_size
    for batch in (1, 2, 5, 16):
        seqs, free = [], list(range(runner.num_blocks))
        rng.shuffle(free)
        for b in range(batch):
            computed = rng.randrange(0, 200)
            blocks = [free.pop() for _ in range(computed // bs + 1)]
            seqs.append(ScheduledSequence(f"r{b}", [rng.randrange(1000)], computed, blocks,
                                          b % 3 != 1, SamplingParams()))
        fast = prepare_decodes(seqs, bs, runner.ops, runner.device)
        general = prepare_general(seqs, bs, runner.ops, runner.device)
        for name, x, y in zip(("ids", "positions", "meta", "logits_indices"), fast, general):
            _same(x, y, f"batch {batch}: {name}")
