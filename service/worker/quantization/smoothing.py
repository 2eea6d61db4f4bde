"""SmoothQuant for the activation-quantizing int8 paths: per-channel input maxima on a
calibration text, and the smoothing factors folded into the model.

SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models", ICML 2023): activation outliers sit in a few input channels;
dividing those channels by `s` and multiplying the weight's columns by `s` leaves the
product unchanged but moves the range into the weights, which per-channel quantization
absorbs. `s` comes from the activation maxima seen on a calibration text
(`CALIBRATION_TEXT`); the model folds `1/s` into the op before the layer (an RMSNorm
weight, the up projection, the V projection), so it costs nothing at run time. Only the
paths that quantize activations (fbgemm's dynamic int8, `torch._int_mm` per token) need it;
weight-only paths are smoothed only where measured to help (see `service.worker.quantization.plan`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch


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


def fold_smoothing(weights: Mapping[str, torch.Tensor | None],
                   act_amax: Mapping[str, torch.Tensor | None], smooth: Collection[str],
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   where: str = "layer") -> dict[str, torch.Tensor | None]:
    """Fold SmoothQuant factors into one decoder layer's weights, for the linear classes in
    `smooth` among "qkv", "o", "gate_up", "down" (others, e.g. the LM head, are left
    alone); each factor s cancels exactly:
        qkv input     = rms_norm(h) * ln1_w  -> ln1_w / s, qkv columns * s
        gate_up input = rms_norm(h) * ln2_w  -> ln2_w / s, gate_up columns * s
        down input    = silu(gate) * up      -> up rows / s, down columns * s
        o input       = attention(v)         -> v rows / s, o columns * s, one s per
                        V channel shared by the Hq / Hkv query heads reading it.

    Args:
        weights: "qkv_w" [(Hq + 2 Hkv) D, H], "qkv_b" [(Hq + 2 Hkv) D] or None, "o_w"
            [H, Hq D], "gate_up_w" [2 I, H], "gate_up_b" [2 I] or None (may be absent),
            "down_w" [H, I], "ln1_w", "ln2_w" [H]. (o's and down's biases are per output:
            no factor touches them.)
        act_amax: class -> [in] max |x| seen on calibration text (``AmaxObserver.amax``).

    Returns:
        New tensors under the same keys (the inputs are not modified).

    Raises:
        ValueError: a class in `smooth` without observed maxima.
    """
    w = {k: None if v is None else v.clone() for k, v in weights.items()}
    smooth = [n for n in smooth if n in ("qkv", "o", "gate_up", "down")]  # not the LM head
    for n in smooth:
        if act_amax.get(n) is None:
            raise ValueError(f"{where}: no calibration input was observed for {n}")
    Hq, Hkv, D = num_heads, num_kv_heads, head_dim
    G = Hq // Hkv
    qkv_w, o_w, gate_up_w, down_w = w["qkv_w"], w["o_w"], w["gate_up_w"], w["down_w"]
    ln1_w, ln2_w, qkv_b = w["ln1_w"], w["ln2_w"], w["qkv_b"]
    assert qkv_w is not None and o_w is not None and gate_up_w is not None
    assert down_w is not None and ln1_w is not None and ln2_w is not None
    if "qkv" in smooth:
        s = smoothing_factors(act_amax["qkv"], qkv_w.abs().amax(0))  # type: ignore[arg-type]
        ln1_w /= s
        qkv_w *= s
    if "gate_up" in smooth:
        s = smoothing_factors(act_amax["gate_up"], gate_up_w.abs().amax(0))  # type: ignore[arg-type]
        ln2_w /= s
        gate_up_w *= s
    if "down" in smooth:
        s = smoothing_factors(act_amax["down"], down_w.abs().amax(0))  # type: ignore[arg-type]
        gate_up_w[gate_up_w.shape[0] // 2:] /= s[:, None]  # the up half
        gate_up_b = w.get("gate_up_b")
        if gate_up_b is not None:  # mlp_bias: up's bias scales with its rows
            gate_up_b[gate_up_b.shape[0] // 2:] /= s
        down_w *= s
    if "o" in smooth:
        # [Hq D] -> [Hkv, G, D] -> max over the G heads that share a V channel
        amax = act_amax["o"]
        assert amax is not None
        s = smoothing_factors(amax.view(Hkv, G, D).amax(1).reshape(-1),
                              o_w.abs().amax(0).view(Hkv, G, D).amax(1).reshape(-1))
        o_w *= s.view(Hkv, 1, D).expand(Hkv, G, D).reshape(-1)
        v_rows = slice((Hq + Hkv) * D, (Hq + 2 * Hkv) * D)
        qkv_w[v_rows] /= s[:, None]
        if qkv_b is not None:
            qkv_b[v_rows] /= s
    return w


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
