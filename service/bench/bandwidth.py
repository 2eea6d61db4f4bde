"""The memory-bandwidth bound of a decode step: weight bytes a step reads / measured read
bandwidth.

A one-sequence decode step streams every linear layer's weights from DRAM once (a
135M-parameter model's weights are several times the last-level cache), so its time is at
least `decode_weight_bytes / read_bandwidth`. The engine-only benchmark states both and the
fraction of that bound a step reaches (issue 22 asks for 60% on the machine measured).

The bandwidth is torch's `x.sum()` over 256 MiB of float32 with the threads the engine
uses, 10 times: a plain streaming read, the same kind of traffic as a GEMV over packed
weights. The best of the 10 gives the bound (the strict one); the median is stated beside
it, as single reads vary on a shared host. Neither is what a step's own pattern of reads
gets: on the Zen 4 of 2026-12-05 (commit 16fdc9c), in minutes when this read 48-51 GB/s, a plain cold read
of a step's packed weights split as its 121 calls split them ran at 23-33 GB/s. It moves
with the machine's load (a shared host's neighbours), so the benchmark measures it before
and after its runs and states both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from service.worker.quantization.choice import weight_bytes
from service.worker.quantization.plan import DispatchLinear

if TYPE_CHECKING:
    from service.worker.model import LlamaModel


@dataclass(frozen=True)
class ReadBandwidth:
    """Read bandwidth of `x.sum()` over a buffer, in GB/s (1e9 bytes/s): the best and the
    median of the repeats."""

    best_gb_s: float
    median_gb_s: float


def read_bandwidth(mib: int = 256, repeats: int = 10) -> ReadBandwidth:
    """Best-of-`repeats` and median read bandwidth of `x.sum()` over `mib` MiB of float32,
    with torch's current thread count. Allocates the buffer for the call only. Raises
    ValueError for a non-positive size or repeat count."""
    if mib <= 0 or repeats <= 0:
        raise ValueError(f"mib and repeats must be positive, got {mib}, {repeats}")
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()  # faults the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    nbytes = x.numel() * 4
    return ReadBandwidth(nbytes / min(times) / 1e9, nbytes / statistics.median(times) / 1e9)


def decode_weight_bytes(model: LlamaModel) -> int:
    """Bytes of linear-layer weights (scales and minima included) a one-row step reads: every
    decoder layer's qkv, o, gate_up and down and the LM head, each in the form its path at
    the one-row bucket reads (a DispatchLinear's first path). Norm weights and the one
    embedding row (a few KB) are left out."""
    return sum(weight_bytes(lin.fns[0] if isinstance(lin, DispatchLinear) else lin)
               for lin in model.linears())


def bound_ms(weight_bytes_per_step: int, gb_s: float) -> float:
    """The bandwidth bound of a step in ms: bytes / (gb_s * 1e9) * 1e3."""
    return weight_bytes_per_step / (gb_s * 1e6)


def bound_fraction(ms_per_step: float, weight_bytes_per_step: int, gb_s: float) -> float:
    """The fraction of the bandwidth bound a step of `ms_per_step` reaches: bound_ms / step
    ms. Raises ValueError for a non-positive input."""
    if ms_per_step <= 0 or weight_bytes_per_step <= 0 or gb_s <= 0:
        raise ValueError("step time, bytes and bandwidth must be positive")
    return bound_ms(weight_bytes_per_step, gb_s) / ms_per_step
