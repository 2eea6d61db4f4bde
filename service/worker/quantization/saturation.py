"""The worst-case probe of an int8 path: inputs whose products saturate an int16.

The random correctness check (``choice.relative_errors``) cannot see saturation: Gaussian
activations quantize far from the top of their range, so adjacent pair sums stay small.
This probe builds the inputs where it happens (``isa``: a u8 x s8 pair sum of 255 * 127 * 2
overflows int16 without VNNI):

    weight rows, by output channel o % 4       activation rows, by row m % 4
      0: +1 +1 +1 +1 ...  (int8 +127)            0: +1 +1 +1 +1 ...  (top of the range)
      1: -1 -1 -1 -1 ...  (int8 -127)            1: -1 -1 -1 -1 ...
      2: +1 +1 -1 -1 ...  (signs by pair)        2: +1 +1 -1 -1 ...
      3: +1 -1 +1 -1 ...                         3: +1 +1 +1 +1 ... but 0 in every 4th

Every entry is exactly representable after per-channel and per-token quantization, so a
path that does not saturate gives the answer within rounding (the answers are integers up
to K, exact in fp32); one that saturates is off by about half (e.g. 291 for 576). The
probe runs at the layer's own K and at each row bucket's row count (a library may pick
another kernel by row count), with at most PROBE_N output channels: the instruction a
kernel uses does not depend on N, and the LM head's 49,152 channels would cost seconds on
paths that are slow here.
"""

from __future__ import annotations

import math

import torch

from service.worker.quantization.paths import LayerWeights, LinearPath
from service.worker.quantization.plan import BUCKETS

__all__ = ["PROBE_N", "needs_probe", "probe_inputs", "saturation_errors"]

PROBE_N = 256
"""Output channels of the probe weight (a multiple of the 4 patterns)."""


def needs_probe(path: LinearPath) -> bool:
    """Whether `path` multiplies in int8 (int8 mode, or it quantizes activations)."""
    return path.mode == "int8" or path.quantizes_activations


def _patterns(k: int) -> torch.Tensor:
    """[4, k]: the four sign patterns of the module docstring (rows 0-3 of the weight)."""
    i = torch.arange(k)
    pair = torch.where((i // 2) % 2 == 0, 1.0, -1.0)   # +1 +1 -1 -1 ...
    alt = torch.where(i % 2 == 0, 1.0, -1.0)           # +1 -1 +1 -1 ...
    return torch.stack([torch.ones(k), -torch.ones(k), pair, alt])


def probe_inputs(n: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [n, k], x [rows, k], exact y = x @ weight^T [rows, n]), float32, by the
    patterns in the module docstring."""
    p = _patterns(k)                                       # [4, k]
    weight = p[torch.arange(n) % 4].contiguous()           # [n, k]
    top = torch.ones(k)
    top[::4] = 0.0                                         # +1 but 0 in every 4th
    kinds = torch.stack([p[0], p[1], p[2], top])           # [4, k]
    x = kinds[torch.arange(rows) % 4].contiguous()         # [rows, k]
    return weight, x, x @ weight.t()  # integer sums below 2^24: exact


def saturation_errors(path: LinearPath, k: int, n: int, *,
                      buckets: tuple[int, ...] = BUCKETS,
                      inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[float, ...]:
    """Per row bucket, the relative error |y - y_exact| / |y_exact| (Frobenius) of `path`
    on the probe inputs of a [n, k] layer, called as the bucket calls it: one-row calls for
    the 1-row bucket, one call of `rows` rows otherwise. inf when the output is not finite
    or the path raises. inputs: ``probe_inputs(min(n, PROBE_N), k, max(buckets))`` when
    given (to share them between the paths of one layer)."""
    weight, x, ref = inputs or probe_inputs(min(n, PROBE_N), k, max(buckets))
    try:
        fn = path.bind(LayerWeights(weight, None))
    except (RuntimeError, ValueError):
        return tuple(math.inf for _ in buckets)
    out = []
    for rows in buckets:
        try:
            y = (torch.cat([fn(x[i:i + 1]) for i in range(4)]) if rows == 1
                 else fn(x[:rows]))
        except (RuntimeError, ValueError):
            out.append(math.inf)
            continue
        r = ref[:y.shape[0]].double()
        y = y.double()
        out.append(float((y - r).norm() / r.norm()) if bool(torch.isfinite(y).all())
                   else math.inf)
    return tuple(out)
