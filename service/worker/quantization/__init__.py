"""Linear layers of the model: auto (the default: the checkpoint's own weights), dense fp32,
int8 or int4 on the CPU, and the batch-invariant variants; which kernel serves each layer is
measured per machine.

    linear.py       the Linear interface and DenseLinear (F.linear)
    torch_int8.py   int8 through torch: fbgemm's dynamic linear, torch._int_mm per token
    smoothing.py    SmoothQuant factors and the calibration text (activation-quantizing paths)
    paths.py        every way to run a linear layer, per mode (ours: kernels/quant_linear_cpu.py)
    choice.py       time each path per layer shape and row bucket, pick the fastest correct
    plan.py         the chosen paths of a model: a Linear per layer that dispatches by rows
"""

from __future__ import annotations

from service.worker.quantization.linear import DenseLinear, Linear
from service.worker.quantization.smoothing import (CALIBRATION_ANSWER, CALIBRATION_QUESTION,
                                            CALIBRATION_TEXT, SMOOTHING_ALPHA, AmaxObserver,
                                            calibration_token_ids, smoothing_factors)
from service.worker.quantization.torch_int8 import Int8Linear, cpu_has_vnni, quantize_per_channel

QUANTIZATIONS = ("auto", "auto-a8", "int8", "int4")
"""Values of `ModelConfig.quantization` besides None (dense weights)."""

__all__ = [
    "AmaxObserver", "CALIBRATION_ANSWER", "CALIBRATION_QUESTION", "CALIBRATION_TEXT",
    "DenseLinear", "Int8Linear", "Linear", "QUANTIZATIONS", "SMOOTHING_ALPHA",
    "calibration_token_ids", "cpu_has_vnni", "quantize_per_channel", "smoothing_factors",
]
