"""The chosen linear paths of a model (from ``service.worker.quantization.choice``), and the Linear
that dispatches a call to its row bucket's path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels import quant_linear_cpu as qlc
from service.worker.quantization.linear import Linear
from service.worker.quantization.paths import INT4_GROUP, PATHS, LayerWeights

if TYPE_CHECKING:
    from service.worker.gguf_weights import BlockWeight

BUCKETS = (1, 16, 64, 512)
"""Row counts the paths are timed at; a call uses the nearest on a log scale."""
_EDGES = (4, 32, 181)  # geometric midpoints: sqrt(1 * 16), sqrt(16 * 64), sqrt(64 * 512)


def bucket_index(rows: int) -> int:
    """Index in BUCKETS of the bucket serving a call of `rows` rows.

    E.g. 1-3 rows -> 0 (1), 4-31 -> 1 (16), 32-180 -> 2 (64), 181+ -> 3 (512).
    """
    for i, edge in enumerate(_EDGES):
        if rows < edge:
            return i
    return len(_EDGES)


def bucket_rows(index: int) -> str:
    """The row counts bucket `index` serves, e.g. "1-3", "4-31", "181+"."""
    lo = ((1,) + _EDGES)[index]
    return f"{lo}-{_EDGES[index] - 1}" if index < len(_EDGES) else f"{lo}+"


def substitute(name: str, lw: LayerWeights, batch_invariant: bool) -> str:
    """A path for a layer that the chosen path `name` cannot serve (it runs another native
    format than the layer has): our kernel of the layer's own format on the same build, with
    the same activations where that format has them (``cpp-q8_0-avx2`` for
    ``cpp-q4_1-avx2``, ``cpp-q4_kx16-avx512`` for ``cpp-splitx16-avx512``), else ``cpp-f32``
    on that build when batch invariant or the chosen path is row-invariant, else ``fp32``."""
    isa = name.rsplit("-", 1)[-1] if name.startswith("cpp-") else \
        (qlc.available_isas() or ("avx2",))[0]
    act = "x16" if name.startswith("cpp-") and name.rsplit("-", 1)[0].endswith("x16") else ""
    if lw.native_fmt is not None:
        for own in (f"cpp-{lw.native_fmt}{act}-{isa}", f"cpp-{lw.native_fmt}-{isa}"):
            if own in PATHS:
                return own
    if isa in qlc.ACT16_VARIANTS:  # a tile build serves x16 formats only: its base build
        isa = "avx512"
    return f"cpp-f32-{isa}" if batch_invariant or PATHS[name].row_invariant else "fp32"


class DispatchLinear:
    """A Linear whose call of M rows runs the path chosen for M's bucket.

    fns: one callable per BUCKETS entry (the same object where buckets share a path).
    names: the path names, for inspection.
    """

    __slots__ = ("fns", "names", "in_features", "out_features")

    def __init__(self, fns: list[Callable[[torch.Tensor], torch.Tensor]], names: tuple[str, ...],
                 in_features: int, out_features: int) -> None:
        if len(fns) != len(BUCKETS) or len(names) != len(BUCKETS):
            raise ValueError(f"need one path per bucket {BUCKETS}, got {names}")
        self.fns, self.names = fns, names
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m < 4:
            return self.fns[0](x)
        if m < 32:
            return self.fns[1](x)
        return self.fns[2](x) if m < 181 else self.fns[3](x)


@dataclass(frozen=True)
class LinearPlan:
    """Which path serves each linear shape class at each row bucket, and why.

    choices: class -> one path name per BUCKETS entry.
    timings_ms: class -> per bucket, path -> measured ms per call (correct paths only; an
        empty dict where the bucket was not timed and takes the bucket below's choice).
    errors: class -> path -> relative error vs fp32 in one-row calls and in 8-row calls
        (``choice.relative_errors``).
    unavailable: path -> why it cannot run here.
    natives: (layer index or None for the LM head, class) -> the checkpoint's own blocks of
        that layer (auto on a GGUF file), used by ``make_linear``; emptied once the model's
        layers are made (``without_natives``).
    saturation: class -> int8 path -> relative error per bucket on worst-case inputs
        (``saturation.saturation_errors``); above the mode's bound a path is not chosen.
    fused_rows: buckets of at most this many rows took a C++ path within
        ``choice.FUSION_SLACK`` of the fastest (for the fused forward); 0: the fastest.
    """

    mode: str
    batch_invariant: bool
    choices: Mapping[str, tuple[str, ...]]
    timings_ms: Mapping[str, list[dict[str, float]]] = field(default_factory=dict)
    errors: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)
    unavailable: Mapping[str, str] = field(default_factory=dict)
    int4_group: int | None = None
    natives: Mapping[tuple[int | None, str], BlockWeight] = field(default_factory=dict)
    saturation: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    fused_rows: int = 0

    def without_natives(self) -> LinearPlan:
        """The plan without its natives (their unpacked values are not kept once packed)."""
        return dataclasses.replace(self, natives={})

    def make_linear(self, cls: str, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    layer: int | None = None) -> Linear:
        """The Linear for one layer of class `cls` ([N, K] float32 weight, or None where the
        layer has native blocks, dequantized only if a path needs them; [N] bias or None;
        layer: its decoder layer index, None for the LM head, which finds its native blocks
        in ``natives``): the chosen path itself when
        every bucket shares it, else a DispatchLinear. Paths over the same packed form share
        it (e.g. the C++ int8 kernel and int8-dequant-mm). A layer whose native format is
        not its class's (a GGUF file mixing block types), so that a chosen path cannot serve
        it, gets ``substitute``'s path for that bucket.

        Raises KeyError for a class the plan does not cover."""
        lw = LayerWeights(weight, bias, self.int4_group or INT4_GROUP,
                          self.natives.get((layer, cls)))
        names = tuple(n if PATHS[n].accepts(lw) else substitute(n, lw, self.batch_invariant)
                      for n in self.choices[cls])
        bound: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name in names:
            if name not in bound:
                bound[name] = PATHS[name].bind(lw)
        if len(bound) == 1:
            return bound[names[0]]  # type: ignore[return-value]
        n, k = lw.shape
        return DispatchLinear([bound[n] for n in names], names, k, n)

    def smoothed_classes(self) -> frozenset[str]:
        """Decoder-layer classes served by an activation-quantizing path at some bucket: the
        ones SmoothQuant is folded into (never the LM head, tied to the embedding)."""
        return frozenset(cls for cls, names in self.choices.items() if cls != "lm_head"
                         and any(PATHS[n].quantizes_activations for n in names))

    def all_fp32(self) -> bool:
        """Whether fp32 F.linear serves everything (no faster correct path here)."""
        return all(n == "fp32" for names in self.choices.values() for n in names)

    def summary(self) -> str:
        """One line: class=path per bucket, e.g. "qkv=cpp-int8-avx512,..,fbgemm,fbgemm"."""
        return "; ".join(f"{cls}={','.join(names)}" for cls, names in self.choices.items())

    def table(self) -> str:
        """The measurements behind the choice, one line per (class, bucket), '*' = chosen."""
        lines = [f"linear kernels for quantization={self.mode}"
                 f"{' batch-invariant' if self.batch_invariant else ''} "
                 f"({torch.get_num_threads()} threads), ms per call at rows {BUCKETS}:"]
        for cls, rows in self.timings_ms.items():
            errs = self.errors.get(cls, {})
            for b, row in enumerate(rows):
                if not row:  # e.g. the LM head at 512 rows: it gets one row per sampling seq
                    lines.append(f"  {cls:<8} {BUCKETS[b]:>4} rows: not timed; "
                                 f"{self.choices[cls][b]} (as {BUCKETS[b - 1]} rows)")
                    continue
                cells = " ".join(f"{'*' if name == self.choices[cls][b] else ''}{name} {ms:.3f}"
                                 for name, ms in row.items())
                lines.append(f"  {cls:<8} {BUCKETS[b]:>4} rows: {cells}")
            lines.append(f"  {cls:<8} error vs fp32 (1 row / 8 rows): "
                         + " ".join(f"{n} {e1:.4f}/{e8:.4f}" for n, (e1, e8) in errs.items()))
            if self.saturation.get(cls):
                lines.append(f"  {cls:<8} error on worst-case int8 inputs per bucket: " + " ".join(
                    f"{n} {'/'.join(f'{e:.4f}' for e in es)}"
                    for n, es in self.saturation[cls].items()))
        for name, why in self.unavailable.items():
            lines.append(f"  not available: {name}: {why}")
        return "\n".join(lines)
