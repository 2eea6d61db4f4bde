"""Put a model's linear layers on the kernels chosen by measurement (start-up, once)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from service.worker.quantization.choice import choose_plan
from service.worker.quantization.paths import candidates, machine_note
from service.worker.quantization.plan import LinearPlan

if TYPE_CHECKING:
    from service.worker.model import LlamaModel

log = logging.getLogger(__name__)


@torch.inference_mode()
def apply_linear_plan(model: LlamaModel, mode: str, batch_invariant: bool,
                      calibrate: Callable[[], list]) -> LinearPlan:
    """Choose each linear layer's kernel by measurement (``choose_plan``; timings cached per
    machine), log the table, calibrate SmoothQuant where an activation-quantizing path
    serves (``calibrate()``: per-layer AmaxObservers), and replace the model's linear layers.

    mode: "none" (fp32 weights; batch invariance only), "int8" or "int4".

    Raises:
        ValueError: no kernel of the mode can run here (int4 or batch-invariant without the
            C++ kernels).
    """
    plan = choose_plan(model.linear_weights(), candidates(mode, batch_invariant), mode,
                       batch_invariant)
    log.info("%s\n  (%s)", plan.table(), machine_note())
    if mode == "int8" and plan.all_fp32():
        log.warning("--quantization int8: no int8 kernel beats fp32 on this CPU (%s); "
                    "serving fp32", machine_note())
    smooth = plan.smoothed_classes()
    observed = calibrate() if smooth else None
    model.quantize(plan.make_linear, None if mode == "none" else mode, observed, smooth)
    log.info("linear layers: %s (SmoothQuant on %s)", plan.summary(),
             ", ".join(sorted(smooth)) or "none")
    return plan
