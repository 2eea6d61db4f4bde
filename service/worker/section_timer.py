"""Where the milliseconds of a step go, measured from outside the model's math.

`SectionTimer.instrument(model)` wraps, for the duration of a block, each linear layer and
the attention op of a `LlamaModel` so that they lap the timer: time up to a linear call is
"other", the call itself "linear"; the attention op (K/V store included) is "attention";
a fused forward (one native call for the whole model) is "fused".
The model's forward has no timing code; the runner laps "build_batch" and "sample".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from service.worker.model import LlamaModel

LINEARS = ("qkv", "o", "gate_up", "down")


class SectionTimer:
    """Wall time of a step split into named sections (benchmarks only).

    `start()` then `lap(name)` after each section adds the time since the previous mark to
    `seconds[name]` (seconds). On CUDA every mark synchronises the device, so only use a
    timer when measuring.
    """

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = device.type == "cuda"
        self._last = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._last = self._now()

    def lap(self, section: str) -> None:
        now = self._now()
        self.seconds[section] = self.seconds.get(section, 0.0) + now - self._last
        self._last = now

    def _lapped(self, fn: Callable, section: str) -> Callable:
        def call(*args, **kwargs):
            self.lap("other")
            out = fn(*args, **kwargs)
            self.lap(section)
            return out
        return call

    @contextmanager
    def instrument(self, model: LlamaModel) -> Iterator[None]:
        """Within the block, `model`'s linear layers (LM head included) lap "linear", its
        attention op "attention" and its fused forwards "fused", each after lapping "other";
        restored on exit."""
        layers = [{n: getattr(layer, n) for n in LINEARS} for layer in model.layers]
        ops, lm_head, fused = model.ops, model.lm_head, model.fused
        model.fused = {b: self._lapped(f, "fused") for b, f in fused.items()}
        for layer, saved in zip(model.layers, layers):
            for n, lin in saved.items():
                setattr(layer, n, self._lapped(lin, "linear"))
        model.lm_head = self._lapped(lm_head, "linear")
        model.ops = dataclasses.replace(ops, attention=self._lapped(ops.attention, "attention"))
        try:
            yield
        finally:
            for layer, saved in zip(model.layers, layers):
                for n, lin in saved.items():
                    setattr(layer, n, lin)
            model.lm_head, model.ops, model.fused = lm_head, ops, fused
