"""Which steps run as one native call (the fused CPU forward), and building it (policy).

`--cpu-fused-decode auto|on|off` (`ModelConfig.cpu_fused_decode`). The fused forward
(`kernels.decode_forward_cpu`) runs the kernels the linear plan chose, by pointer, so it
can serve a row bucket (`quantization.plan.BUCKETS`) only where every linear layer's path
at that bucket is one of our C++ kernels (`CppLinear`): then it runs the very same linear
kernels as the unfused forward, minus about 15 Python-level calls a layer. A bucket whose
plan picked `F.linear`, int_mm, fbgemm or a dequantizing path stays unfused.

It serves the steps whose every row the C++ decode attention serves: decode-only steps,
and in the batch-invariant mode every step (prefill rows attend as decodes over their own
prefix there), so a row's numerics do not depend on which steps it shared.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kernels import decode_forward_cpu as dfc
from service.worker.quantization.census import LAYER_CLASSES
from service.worker.quantization.paths import CppLinear
from service.worker.quantization.plan import BUCKETS, DispatchLinear, bucket_rows

if TYPE_CHECKING:
    from service.worker.model import LlamaModel

log = logging.getLogger(__name__)

SETTINGS = ("auto", "on", "off")


def _cpp_at(linear: object, bucket: int) -> tuple | None:
    """(packed weight, isa) of the C++ kernel serving `linear` at `bucket`, or None."""
    fn = linear.fns[bucket] if isinstance(linear, DispatchLinear) else linear
    return (fn.packed, fn.isa) if isinstance(fn, CppLinear) else None


def fusable_buckets(model: LlamaModel) -> list[int]:
    """Indices into BUCKETS where every linear layer (LM head included) is a C++ kernel."""
    linears = model.linears()
    return [b for b in range(len(BUCKETS)) if all(_cpp_at(lin, b) for lin in linears)]


def build_fused_forward(model: LlamaModel, kv_caches: list[torch.Tensor], setting: str,
                        decode_kernel: str) -> tuple[dict[int, dfc.FusedForward], str]:
    """The fused forwards of `model` per row bucket, and one line on why (for the log).

    setting: "off" (none), "auto" (where it applies and builds) or "on" (the same, but an
    error where it cannot serve any bucket). decode_kernel: the runner's CPU decode
    attention ("cpp" needed: the fused forward attends with that kernel).

    Raises:
        ValueError: an unknown setting; "on" where nothing can be fused (the reason given).
    """
    if setting not in SETTINGS:
        raise ValueError(f"cpu_fused_decode must be one of {SETTINGS}, got {setting!r}")
    if setting == "off":
        return {}, "off"
    why = None
    buckets: list[int] = []
    embed = model.embed if model.block_embed is None else model.block_embed
    if embed.dtype != torch.float32 or (model.embed is not None
                                        and model.embed.device.type != "cpu"):
        why = "needs float32 on the CPU"
    elif decode_kernel != "cpp":
        why = f"needs the C++ decode attention (decode kernel is {decode_kernel})"
    elif (problem := dfc.build_problem()) is not None:
        why = problem
    else:
        buckets = fusable_buckets(model)
        if not buckets:
            why = "no row bucket is served by C++ linear kernels alone (e.g. F.linear serves fp32)"
    if why is not None:
        if setting == "on":
            raise ValueError(f"cpu_fused_decode 'on' (--cpu-fused-decode on) cannot be used: {why}")
        return {}, f"off ({why})"
    out: dict[int, dfc.FusedForward] = {}
    for b in buckets:
        layers = [dfc.FusedLayer(*(_cpp_at(getattr(layer, n), b) for n in LAYER_CLASSES),
                                 ln1=layer.ln1_w, ln2=layer.ln2_w, kv=kv)
                  for layer, kv in zip(model.layers, kv_caches)]
        out[b] = dfc.FusedForward(
            layers, _cpp_at(model.lm_head, b), embed, model.norm_w, model.cos, model.sin,
            num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim, intermediate=model.layers[0].down.in_features,
            eps=model.eps, scale=model.scale)
    rows = ", ".join(bucket_rows(b) for b in buckets)
    return out, f"on for steps of {rows} rows"
