"""Linear layers of the model: dense (the default) or int8 on the CPU.

int8 is torch's dynamic quantization (as `torch.ao.quantization.quantize_dynamic`
does it for `nn.Linear`, Jacob et al., "Quantization and Training of Neural
Networks for Efficient Integer-Arithmetic-Only Inference", CVPR 2018), through
torch's own fbgemm kernels:

- weights: symmetric, per output channel: `W[o, :] ~= scale[o] * Wq[o, :]`,
  `Wq` int8 in [-127, 127], `scale[o] = max|W[o, :]| / 127`; quantized and
  prepacked once at load (`torch.ops.quantized.linear_prepack`);
- activations: quantized per call to uint8 over the row block's own [min, max]
  range (per tensor), multiplied in int8 x uint8 -> int32 and rescaled to fp32
  (`torch.ops.quantized.linear_dynamic`), bias added in fp32.

Two refinements keep a small model's int8 output close to fp32 (measured by
`python -m service.bench.int8_accuracy`):

- SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training
  Quantization for Large Language Models", ICML 2023): activation outliers sit in a
  few input channels; dividing those channels by `s` and multiplying the weight's
  columns by `s` leaves the product unchanged but moves the range into the weights,
  which per-channel quantization absorbs. `s` comes from the activation maxima seen on
  a calibration text (`CALIBRATION_TEXT`); the model folds `1/s` into the op before
  the layer (an RMSNorm weight, the up projection, the V projection), so it costs
  nothing at run time.
- Per-token activations where outliers are per token (the MLP down projection and
  the LM head, `per_token=True`): each row gets its own int8 scale and the product
  runs in `torch._int_mm` (int8 x int8 -> int32), instead of one uint8 range for the
  whole batch, which a single token with a huge activation would ruin for all rows.

Only the matrix products change; everything else in the model stays fp32.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("int8",)
"""Values of `ModelConfig.quantization` besides None (dense weights)."""

_ENGINE = "fbgemm"


class Linear(Protocol):
    """`y = x @ W^T (+ b)`: x [T, in] float32 -> y [T, out] float32."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """`F.linear` with the weight in the `[out, in]` layout it reads fastest.

    Args:
        weight: [out, in]; bias: [out] or None. Kept as given (same dtype, device).
    """

    __slots__ = ("weight", "bias", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        _check_weight(weight, bias)
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        reduce_range: quantize fbgemm's activations to 7 bits, needed on CPUs without
            VNNI whose int16 accumulation can saturate; None: only on such CPUs.

    Raises:
        ValueError: a weight not on the CPU, bad shapes.
        RuntimeError: this torch build has no fbgemm quantized engine (x86 only).

    `qweight` [out, in] int8 and `scale` [out] float32 are kept for inspection.
    """

    __slots__ = ("qweight", "scale", "bias", "per_token", "reduce_range", "in_features",
                 "out_features", "_packed", "_qweight_t")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 per_token: bool = False, reduce_range: bool | None = None) -> None:
        _check_weight(weight, bias)
        if weight.device.type != "cpu":
            raise ValueError(f"int8 linear layers run on the CPU, weight is on {weight.device}")
        q, self.scale = quantize_per_channel(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.per_token = per_token
        self.reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range
        self.out_features, self.in_features = weight.shape
        # _int_mm multiplies [T, in] by [in, out]; keep that copy and view it as [out, in]
        self._qweight_t = q.t().contiguous() if per_token else None
        self.qweight = q if self._qweight_t is None else self._qweight_t.t()
        with _quantized_engine(_ENGINE), warnings.catch_warnings():
            # quantized tensors are deprecated as a public type; the packed kernel is not
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            qw = torch._make_per_channel_quantized_tensor(
                q, self.scale.double(), torch.zeros(self.out_features, dtype=torch.int64), 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, self.bias)

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


class AmaxObserver:
    """Calls `inner` and keeps the per-input-channel max |x| of all inputs seen.

    amax: [in] float32, None until a non-empty input passed.
    """

    __slots__ = ("inner", "amax")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0]:
            seen = x.detach().abs().amax(dim=0).float()
            self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
        return self.inner(x)


SMOOTHING_ALPHA = 0.65
"""SmoothQuant's migration strength: measured best of 0.5 / 0.65 / 0.8 on SmolLM2-135M."""


def smoothing_factors(act_amax: torch.Tensor, weight_amax: torch.Tensor,
                      alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant factors `s = act_amax^alpha / weight_amax^(1 - alpha)` per input channel.

    Args:
        act_amax: [in] max |x| of each input channel on calibration data.
        weight_amax: [in] max |W[:, j]| of each input channel (over every output the
            factor is applied to).
        alpha: in [0, 1]; 0 leaves activations alone, 1 moves all their range.

    Returns:
        [in] float32 in [1e-4, 1e4]; 1 where either maximum is 0 (nothing to balance).
        The layer computes `(x / s) @ (W * s)^T`, which equals `x @ W^T`.

    Raises:
        ValueError: mismatched shapes or alpha outside [0, 1].
    """
    if act_amax.shape != weight_amax.shape or act_amax.dim() != 1:
        raise ValueError(f"act_amax {tuple(act_amax.shape)} and weight_amax "
                         f"{tuple(weight_amax.shape)} must be the same [in] shape")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a, w = act_amax.float(), weight_amax.float()
    ok = (a > 0) & (w > 0)
    s = a.clamp(min=1e-12).pow(alpha) / w.clamp(min=1e-12).pow(1.0 - alpha)
    return torch.where(ok, s, torch.ones_like(s)).clamp_(1e-4, 1e4)


# Written for Conveyor: varied English (dialogue, prose, lists, numbers, a little
# code) whose activations set the smoothing factors. Kept apart from the texts the
# accuracy benchmark scores.
CALIBRATION_TEXT = (
    "The harbour master checked the tide tables twice before letting the ferry leave. "
    "Fog had rolled in from the east at dawn, and the lighthouse on the breakwater was "
    "sounding its horn every thirty seconds. On the upper deck, a boy counted gulls "
    "while his grandmother read the weather report aloud: wind from the north-west at "
    "twelve knots, visibility under two kilometres, clearing by noon.\n\n"
    "How do you keep a sourdough starter alive while travelling? Feed it, let it rise "
    "for a few hours, then put it in the fridge; it will wait a week without harm. "
    "When you return, discard half, feed it equal weights of flour and water, and "
    "give it a day at room temperature before baking again.\n\n"
    "Checklist for the data migration on Friday:\n"
    "1. Freeze writes to the orders table at 18:00 UTC.\n"
    "2. Copy 4,250,000 rows in batches of 10,000; verify the row counts match.\n"
    "3. Rebuild the indexes, then run the three slowest reports and compare timings.\n"
    "4. If anything differs by more than 0.5%, roll back and page the on-call engineer.\n\n"
    "def moving_average(values, window=3):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "Glaciers move more quickly than most people expect. Meltwater reaches the bed of "
    "the ice, lubricates it, and the whole mass slides downhill, grinding the rock "
    "beneath into fine flour that turns mountain lakes a milky turquoise. Scientists "
    "measure the speed with stakes drilled into the surface and satellites that "
    "compare photographs taken weeks apart."
)
CALIBRATION_QUESTION = "Can you explain, in two or three sentences, why the sky looks blue?"
CALIBRATION_ANSWER = ("Sunlight contains every colour, and the air scatters short blue "
                      "wavelengths far more than long red ones. That scattered blue light "
                      "reaches our eyes from every direction, so the whole sky glows blue.")


def calibration_token_ids(tokenizer: Any) -> list[int]:
    """Token ids of the calibration data: a chat turn in the model's chat template (its
    special tokens are where outliers tend to be) when it has one, then plain text."""
    ids: list[int] = []
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": CALIBRATION_QUESTION},
             {"role": "assistant", "content": CALIBRATION_ANSWER}], tokenize=False)
        ids = tokenizer.encode(chat, add_special_tokens=False)
    return ids + tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)


def _check_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [out] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")


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
    """Whether this CPU has AVX-512 VNNI or AVX-VNNI (Linux /proc/cpuinfo; False when unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return False
