"""int8 linear layers through torch's own kernels: fbgemm's dynamic int8 linear and
`torch._int_mm` with per-token activation scales.

int8 here is torch's dynamic quantization (as `torch.ao.quantization.quantize_dynamic`
does it for `nn.Linear`, Jacob et al., "Quantization and Training of Neural Networks for
Efficient Integer-Arithmetic-Only Inference", CVPR 2018):

- weights: symmetric, per output channel: `W[o, :] ~= scale[o] * Wq[o, :]`,
  `Wq` int8 in [-127, 127], `scale[o] = max|W[o, :]| / 127`; quantized and
  prepacked once at load (`torch.ops.quantized.linear_prepack`);
- activations: quantized per call to uint8 over the row block's own [min, max]
  range (per tensor), multiplied in int8 x uint8 -> int32 and rescaled to fp32
  (`torch.ops.quantized.linear_dynamic`), bias added in fp32. Without VNNI fbgemm
  accumulates pairs in int16 and can saturate: activations then take 7 bits
  (`reduce_range`), which costs accuracy. Whether VNNI is in force is the instruction
  set fbgemm runs, caps in the environment included (`isa.int8_isa`), not the CPU flag.
- per token (`per_token=True`): each row gets its own int8 scale and the product runs in
  `torch._int_mm` (int8 x int8 -> int32), so one row with a huge activation does not ruin
  the others; fast only on CPUs with VNNI (20-50x slower than fp32 on AVX2-only CPUs).

Both quantize activations, so SmoothQuant (`service.worker.quantization.smoothing`) keeps them
accurate. Which path serves which layer and row count is measured per machine
(`service.worker.quantization.choice`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

import torch

from service.worker.quantization.isa import int8_isa
from service.worker.quantization.linear import check_weight

_ENGINE = "fbgemm"


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a `[out, in]` weight.

    Returns:
        (qweight [out, in] int8 in [-127, 127], scale [out] float32) with
        `weight ~= qweight * scale[:, None]`, the error of each entry at most
        scale / 2. An all-zero row gets scale 1 (its qweight is 0).

    Raises:
        ValueError: weight is not a 2-D floating-point tensor, or not finite.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float [out, in] tensor, got {weight.dtype} "
                         f"shape {tuple(weight.shape)}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} has non-finite entries")
    amax = w.abs().amax(dim=1)                                       # [out]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear:
    """`y ~= x @ W^T + b` with W int8 per output channel and x quantized per call.

    Args:
        weight: [out, in] float CPU tensor; bias: [out] or None.
        per_token: one int8 scale per row of x (symmetric, `torch._int_mm`) instead of
            one uint8 range for the whole x (fbgemm's `linear_dynamic`). A single row is
            always done by fbgemm: per tensor is then per token.
        reduce_range: quantize fbgemm's activations to 7 bits, needed where fbgemm runs
            without VNNI (its int16 accumulation can saturate); None: decided by the
            instruction set in force (``isa.int8_isa().reduce_range``: the CPU's flags
            and the caps FBGEMM_ENABLE_INSTRUCTIONS / ATEN_CPU_CAPABILITY).

    Raises:
        ValueError: a weight not on the CPU, bad shapes.
        RuntimeError: this torch build has no fbgemm quantized engine (x86 only).

    `qweight` [out, in] int8 and `scale` [out] float32 are kept for inspection.
    """

    __slots__ = ("qweight", "scale", "bias", "per_token", "reduce_range", "in_features",
                 "out_features", "_packed", "_qweight_t")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 per_token: bool = False, reduce_range: bool | None = None) -> None:
        check_weight(weight, bias)
        if weight.device.type != "cpu":
            raise ValueError(f"int8 linear layers run on the CPU, weight is on {weight.device}")
        q, self.scale = quantize_per_channel(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.per_token = per_token
        self.reduce_range = int8_isa().reduce_range if reduce_range is None else reduce_range
        self.out_features, self.in_features = weight.shape
        # _int_mm multiplies [T, in] by [in, out]; keep that copy and view it as [out, in]
        self._qweight_t = q.t().contiguous() if per_token else None
        self.qweight = q if self._qweight_t is None else self._qweight_t.t()
        self._packed = self._prepack(q)

    def _prepack(self, q: torch.Tensor) -> Any:
        with _quantized_engine(_ENGINE), warnings.catch_warnings():
            # quantized tensors are deprecated as a public type; the packed kernel is not
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            qw = torch._make_per_channel_quantized_tensor(
                q, self.scale.double(), torch.zeros(self.out_features, dtype=torch.int64), 0)
            return torch.ops.quantized.linear_prepack(qw, self.bias)

    def clone(self) -> Int8Linear:
        """The same layer on distinct memory (int8 weight copied and packed again, not
        re-quantized): benchmarks time copies to stream weights from DRAM."""
        c = Int8Linear.__new__(Int8Linear)
        for name in ("scale", "bias", "per_token", "reduce_range", "in_features",
                     "out_features"):
            setattr(c, name, getattr(self, name))
        c._qweight_t = None if self._qweight_t is None else self._qweight_t.clone()
        c.qweight = self.qweight.clone() if c._qweight_t is None else c._qweight_t.t()
        c._packed = c._prepack(c.qweight.contiguous())
        return c

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] float32 (any row stride) -> [T, out] float32."""
        if self._qweight_t is None or x.shape[0] <= 1:
            return torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)
        # E.g. row [0.5, -2.0] -> scale 2/127, int8 [32, -127]
        row_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)  # [T, 1]
        xq = torch.round(x / row_scale).to(torch.int8)                               # [T, in]
        y = torch._int_mm(xq, self._qweight_t).mul(row_scale).mul_(self.scale)        # [T, out]
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight the int8 product multiplies by."""
        return self.qweight.float() * self.scale[:, None]


@contextmanager
def _quantized_engine(name: str) -> Iterator[None]:
    """Make `name` torch's quantized engine while packing (the packed weight keeps it)."""
    if name not in torch.backends.quantized.supported_engines:
        raise RuntimeError(
            f"int8 quantization needs torch's {name} engine, which this build lacks "
            f"(supported: {', '.join(torch.backends.quantized.supported_engines)}); "
            "it exists on x86-64 CPUs"
        )
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


@functools.lru_cache(maxsize=1)
def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI or AVX-VNNI (Linux /proc/cpuinfo; False when unknown).
    Only the CPU: what the kernels run, caps included, is ``isa.int8_isa``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return False
