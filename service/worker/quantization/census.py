"""How many of a model's linear layers each weight format serves (the start-up log's and
/metrics' `linear_layers{format}`), read from the layers themselves, so that a layer
left out of quantization shows as one more fp32 layer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["LAYER_CLASSES", "layer_formats", "weight_format"]

LAYER_CLASSES = ("qkv", "o", "gate_up", "down")
"""The linear layers of one decoder layer (the LM head is one more)."""


def weight_format(linear: object) -> str:
    """The format of the weight one Linear multiplies by: "fp32", "int8", "int4", "q4_1",
    "q8_0", "q4_1x8" / "q8_0x8" (those weights times int8 activations), or, for a
    layer whose row buckets use different formats, e.g. "fp32+int8"; else its type name."""
    fns = getattr(linear, "fns", None)
    if fns is not None:  # DispatchLinear: a path per row bucket
        return "+".join(sorted({weight_format(f) for f in fns}))
    packed = getattr(linear, "packed", None)
    if packed is not None:  # our C++ kernels' packed weight
        return "fp32" if packed.fmt == "f32" else str(packed.fmt)
    if hasattr(linear, "qweight"):  # torch's int8 (fbgemm, _int_mm)
        return "int8"
    weight = getattr(linear, "weight", None)
    if weight is not None:
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            str(weight.dtype).removeprefix("torch."), str(weight.dtype))
    return type(linear).__name__


def layer_formats(layers: Iterable[object], lm_head: object) -> dict[str, int]:
    """{format: number of linear layers} over every decoder layer's LAYER_CLASSES and the
    LM head, most common first."""
    counts = Counter(weight_format(getattr(layer, n)) for layer in layers for n in LAYER_CLASSES)
    counts[weight_format(lm_head)] += 1
    return dict(counts.most_common())
