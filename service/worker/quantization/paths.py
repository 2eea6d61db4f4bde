"""The ways a linear layer can run on the CPU ("paths"), per quantization mode.

A path turns a layer's fp32 weight and bias into a callable ``x [M, K] -> y [M, N]``
(float32). Which one serves a layer at a given row count is measured per machine
(``service.worker.quantization.choice``); this module only says what exists and builds it.

| path | weights | activations | row-invariant |
|---|---|---|---|
| ``fp32`` | fp32, ``F.linear`` (MKL / oneDNN) | fp32 | no (small M takes another kernel) |
| ``fbgemm`` | int8 per channel | uint8 per tensor (7 bits without VNNI) | no |
| ``int_mm`` | int8 per channel | int8 per token, ``torch._int_mm`` | yes, but not used so |
| ``cpp-{f32,int8,int4}-{avx512,avx2}`` | ours, ``kernels.quant_linear_cpu`` | fp32 | yes |
| ``cpp-{q4_1,q4_0,q8_0}-{avx512,avx2}`` | a GGUF file's own blocks (fp16 scales), ours | fp32 | yes |
| ``cpp-{q4_k,q5_k,q6_k,i8_k}-{avx512,avx2}`` | a GGUF file's K-quant blocks (Q4_K; Q5_K; Q6_K; Q2_K, Q3_K and Q5_1 in 8 bits), ours | fp32 | yes |
| ``cpp-split-{avx512,avx2}`` | a fused layer whose parts' blocks differ (Q4_K_M's qkv), each part in its own format | fp32 | yes |
| ``cpp-{q4_1,q4_0,q8_0}x8-{avx512,avx2}`` | the same blocks, ours, integer dot products | int8 per row and group of 32 | yes |
| ``cpp-{q4_1,q4_0,q8_0,q4_k,q5_k,i8_k,q6_k,split}x16-{avx512,avx2}`` | the same blocks, ours, ``vpmaddwd`` dot products | int16 per row and group of 32 | yes |
| ``{int8,int4,q4_1,q4_0,q8_0,q4_k,q5_k,i8_k,q6_k,split}-dequant-mm`` | ours, dequantized per call, then ``F.linear`` (from 64 rows) | fp32 | no |
| ``bf16`` | bf16 ``[out, in]``, ``F.linear`` (AMX / AVX512-BF16 where the CPU has them) | bf16 | no |

Modes: ``none`` (the fp32 oracle: ``F.linear``), ``int8``, ``int4`` (the weights quantized
here), ``auto-a8`` (auto's candidates plus the ``x8`` paths: the checkpoint's own weights
times int8 activations, llama.cpp's CPU numerics; faster, not exact), and ``auto`` (the
default): the checkpoint's own weights, never re-quantized, never int8 activations: a
GGUF layer in Q4_0 / Q4_1 / Q8_0 is offered the q4_0 / q4_1 / q8_0 paths, one in Q4_K the q4_k
paths, one in Q5_K the q5_k paths, one all in Q6_K the q6_k paths, one in other K-quants the
i8_k paths, one whose parts
are in different formats (Q4_K_M's qkv with a Q6_K attn_v) the split paths (each part in its
own),
over its own blocks (``service.worker.gguf_weights``, ``kernels.gguf_pack``: the format is
``native.fmt``) beside ``fp32`` and ``cpp-f32``
over the same weights dequantized; any other layer ``fp32`` / ``cpp-f32`` / ``bf16``.
``bf16`` is offered in auto, auto-a8, int8 and int4 for calls of 16 rows and more
(``min_rows``) under its own error bound, and in the auto modes only to layers without a
checkpoint's own blocks (a dense checkpoint, a GGUF block type we do not reproduce): it
rounds weights and activations to bf16, so where it serves, outputs are within bf16 rounding
of the checkpoint's, not the same up to summation order. It wins only where the CPU computes
bf16 in hardware (AMX, AVX512-BF16); elsewhere torch emulates it and the timing refuses it.
On a Zen 4 (AVX512-BF16) it won the 64- and 512-row calls of the default GGUF's layers, and
auto's argmax then agreed with the fp32 oracle on 93.9% of a text's positions: a GGUF layer
serves the file's blocks as they are.
The ``x16`` paths (the same blocks times int16 activations: a rounding of at most 2^-16 of
each group's largest |x|, under ACT16_ERROR_BOUND) are offered in auto and auto-a8 alike:
they multiply twice as many int16 pairs an instruction as fp32 FMAs, so compute-bound calls
(prefill chunks, big batches) may run faster, and their error is a few hundred times below
int8 activations' (2e-5 - 5e-5 against 0.005 - 0.03 on the same rows; docs/perf/HISTORY.md,
2026-12-01 accuracy report). Not in --batch-invariant, which keeps the weights' fp32 product.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import quant_linear_cpu as qlc
from kernels.packed_parts import AnyPacked, per_part
from kernels.quant_pack import (PackedWeight, pack_f32, pack_int4, pack_int8,
                                 with_int8_activations, with_int16_activations)
from service.worker.quantization.linear import DenseLinear
from service.worker.quantization.isa import int8_isa
from service.worker.quantization.torch_int8 import Int8Linear

if TYPE_CHECKING:
    from service.worker.gguf_weights import BlockWeight, RawBlocks

    NativeBlocks = BlockWeight | RawBlocks

MODES = ("none", "int8", "int4", "auto", "auto-a8")
INT4_GROUP = 32
"""Input channels per int4 group (a scale and a min per group), as GGUF's Q4_0 / Q4_1 blocks:
the default SmolLM2-135M GGUF is Q4_1, so groups of 32 give back its own 4-bit weights
exactly (relative error 0 on every layer but the tied LM head, 0.10 there); groups of 64
measured 0.08-0.13 (0.10 typical), of 128 0.10-0.16, at the same kernel speed within noise."""
DEQUANT_MIN_ROWS = 64
"""The dequant-mm paths are offered from this many rows: below it a call's fp32 copy of the
weight (written, then read) costs more than the product. Measured at the 8B shape on Zen 3:
at 1 and 16 rows the [49152 x 4096] LM head's q6_k-dequant-mm took 1.5-2.0 s a call against
14 and 67 ms for cpp-q6_kx16, gate_up's 437 against 39 ms at 16 rows; timing them cost a first
start about 8 s."""
SAMPLE_BLOCK = 64
"""A timing sample's parts are cut in whole blocks of this many output channels (the C++
kernels' panel)."""
ERROR_BOUNDS = {"none": 1e-4, "int8": 0.04, "int4": 0.2, "auto": 1e-4, "auto-a8": 1e-4}
"""Largest relative error ``|y - y_fp32| / |y_fp32|`` (``choice.relative_errors``: random
rows with an outlier token, through the model's own weight) a path of each mode may show to
be chosen. On SmolLM2-135M (AVX-512 VNNI), Gaussian rows: int8 weights per channel
0.008-0.013, fbgemm 0.011-0.016, int_mm 0.011-0.015; fbgemm without VNNI needs 7-bit
activations, and without reduce_range there saturates (0.07-0.18): refused. With an outlier
token in the call fbgemm's per-tensor range is refused too (it serves one-row calls only).
int4: see INT4_GROUP. auto: the checkpoint's weights themselves (fp32 summation order only).
A path may bring a bound of its own (``LinearPath.error_bound``: bf16)."""
BF16_ERROR_BOUND = 0.02
"""bf16 rounds each weight and activation to 8 significant bits (relative error 2^-9 each);
over a dot product of a few hundred terms that gives 0.002-0.005 relative error on random
rows (SmolLM2-135M's layers; an outlier token does not change it: one rounding per row).
0.02 is half of int8's bound."""
ACT8_ERROR_BOUND = 0.04
"""int8 activations per row and group of 32 (the ``cpp-{q4_1,q8_0}x8-*`` paths): each x is
rounded to 8 bits against its group's largest |x| (relative error up to 2^-8 of that
maximum); measured 0.005-0.03 on random rows with an outlier token (AVX2 Zen 3). The bound
is int8 mode's. On SmolLM2-135M (docs/perf/HISTORY.md, 2026-12-01 accuracy report) int8
activations on every layer cost teacher-forced top-1 agreement 93.9% and perplexity +1.5%
(the LM head alone 98.2%), so they serve only --quantization auto-a8, never the default."""
ACT16_ERROR_BOUND = 1e-3
"""int16 activations per row and group of 32 (the ``cpp-{native}x16-*`` paths): each x is
rounded against its group's largest |x| with 2^-16 of it at most; measured 2e-5 - 5e-5
relative error (norm) against the weights' fp32 product on random rows with an outlier
token (AVX2 Zen 3), 20 times below this bound, which is 20 times below bf16's."""
BF16_MIN_ROWS = 16
"""bf16 is offered for calls of this many rows and more: prefill chunks and big batches, where
the product is compute-bound and AMX pays; decode-sized calls stream weights, where 4-bit
weights read 4x fewer bytes."""

BF16_BLOCKS_MIN_ROWS = 181
"""bf16 serves a GGUF file's blocks only in calls of this many rows and more (the 512-row
bucket: prefill chunks). On the default SmolLM2-135M (Zen 4, 2026-12-06) bf16 on both the
32-180- and the 181+-row buckets passed the start-up gate but took the accuracy report's
teacher-forced top-1 to 99.1% (issue 47's gate: 99.5%; its sequences of about 100 tokens are
scored in 32-180-row calls), where bf16 on 181+ rows alone kept 99.9%."""


class CppLinear:
    """Our C++ kernel over a packed weight (``kernels.quant_linear_cpu.quant_linear``)."""

    __slots__ = ("packed", "isa", "in_features", "out_features")

    def __init__(self, packed: AnyPacked, isa: str) -> None:
        self.packed, self.isa = packed, isa
        self.out_features, self.in_features = packed.out_features, packed.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qlc.quant_linear(x, self.packed, self.isa)

    def clone(self) -> CppLinear:
        """The same layer on distinct memory (benchmarks stream copies from DRAM)."""
        return CppLinear(_clone_packed(self.packed), self.isa)


class BF16Linear:
    """``F.linear`` over bf16 weights ``[out, in]``: x cast to bf16, the output back to fp32
    (fp32 bias added after). oneDNN runs it on AMX tiles or AVX512-BF16 where the CPU has
    them; other CPUs emulate bf16 (slower than fp32)."""

    __slots__ = ("weight", "bias", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y.add_(self.bias)

    def clone(self) -> BF16Linear:
        """The same layer on distinct memory (benchmarks stream copies from DRAM)."""
        c = BF16Linear.__new__(BF16Linear)
        c.weight, c.bias = self.weight.clone(), self.bias
        c.out_features, c.in_features = self.out_features, self.in_features
        return c


class DequantLinear:
    """Dequantize the packed weight (C++, all threads) then ``F.linear``: for many rows,
    where the product is compute-bound and the dequantization is paid once per call."""

    __slots__ = ("packed", "isa", "bias", "in_features", "out_features")

    def __init__(self, packed: AnyPacked, isa: str) -> None:
        self.packed, self.isa = packed, isa
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self.bias = None if packed.bias is None else packed.bias[:packed.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, qlc.dequantize(self.packed, self.isa), self.bias)

    def clone(self) -> DequantLinear:
        """The same layer on distinct memory (benchmarks stream copies from DRAM)."""
        return DequantLinear(_clone_packed(self.packed), self.isa)


def _clone_packed(p: AnyPacked) -> AnyPacked:
    return per_part(lambda q: dataclasses.replace(q, data=q.data.clone()), p)


class LayerWeights:
    """One layer's fp32 weight [N, K] and bias [N] (or None), with the packed forms the
    paths share built once on first use (e.g. the int8 packing serves both C++ builds and
    the dequantizing path).

    native: the checkpoint's own blocks of this weight (GGUF tensors whose types our kernels
    serve: ``service.worker.gguf_weights.RawBlocks`` or ``BlockWeight``; ``.fmt`` names the
    packed format, ``.pack`` packs it), whose dequantization is `weight`; None for a dense
    checkpoint or a block type served dequantized. weight may be None where native is
    given: it is then dequantized from the blocks on first use (only a path that is not
    native needs it)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 int4_group: int = INT4_GROUP, native: NativeBlocks | None = None) -> None:
        if weight is None and native is None:
            raise ValueError("a layer needs its weight or its native blocks")
        self._weight, self.bias, self.int4_group = weight, bias, int4_group
        self.native = native

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        """[N, K] float32: as given, or the native blocks dequantized: by our C++ kernel from
        their packed form where they have one and it builds (the same bits as gguf-py's
        numpy reference, ``tests/kernels/test_gguf_pack.py``; a 3B Q4_K_M file's layers in 8.6 s,
        page faults included, where the numpy one took 25 s on 2 Zen 4 cores), else by
        ``native.dequantize()``."""
        if self._weight is not None:
            return self._weight
        assert self.native is not None
        isa = _dequant_isa() if self.native.fmt is not None else None
        if isa is not None:
            return qlc.dequantize(self.packed_native, isa)
        return self.native.dequantize()

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output and input features."""
        if self._weight is not None:
            return tuple(self._weight.shape)  # type: ignore[return-value]
        assert self.native is not None
        return self.native.out_features, self.native.in_features

    def check_sample(self, rows: int) -> LayerWeights:
        """What the correctness check runs through: this layer, or, where it holds only
        native blocks that can be cut (``RawBlocks.head_rows``), the first `rows` output
        rows of each of its parts (every part's block type stays in the sample)."""
        head_rows = getattr(self.native, "head_rows", None)
        if self._weight is not None or head_rows is None or self.shape[0] <= rows:
            return self
        sample, index = head_rows(rows)
        return LayerWeights(None, None if self.bias is None else self.bias[index],
                            self.int4_group, native=sample)

    def timing_sample(self, channels: int) -> tuple[LayerWeights, float]:
        """(a layer of about `channels` of this layer's output channels, this layer's N over
        the sample's): what a compute-bound bucket is timed on (``choice.SAMPLE_FROM_ROWS``),
        its time then scaled by that ratio. Each part keeps its share of the channels, in
        whole blocks of SAMPLE_BLOCK, so that every part's block type is timed in about its
        proportion. (self, 1.0) where N is at most twice `channels`, or the native blocks
        cannot be cut."""
        n = self.shape[0]
        if n <= 2 * channels:
            return self, 1.0
        fraction = channels / n
        native, index = self.native, None
        head_rows = getattr(native, "head_rows", None)
        if head_rows is not None:
            native, index = head_rows([min(r.shape[0], SAMPLE_BLOCK * math.ceil(
                r.shape[0] * fraction / SAMPLE_BLOCK)) for r in native.raw])
        else:
            index = torch.arange(SAMPLE_BLOCK * math.ceil(channels / SAMPLE_BLOCK))
            if native is not None:  # BlockWeight: one format, rows in order
                native = dataclasses.replace(native, q=native.q[index], d=native.d[index],
                                             m=None if native.m is None else native.m[index])
        weight = None if self._weight is None else self._weight[index]
        sample = LayerWeights(weight, None if self.bias is None else self.bias[index],
                              self.int4_group, native=native)
        return sample, n / sample.shape[0]

    @property
    def native_fmt(self) -> str | None:
        """"q4_1", "q4_0", "q8_0", "q4_k", "i8_k", "q6_k", "q5_k", "split" or None (no native
        blocks)."""
        return None if self.native is None else self.native.fmt

    @functools.cached_property
    def packed_native(self) -> AnyPacked:
        assert self.native is not None, "no native blocks for this layer"
        return self.native.pack(self.bias)

    @functools.cached_property
    def packed_f32(self) -> PackedWeight:
        return pack_f32(self.weight, self.bias)

    @functools.cached_property
    def packed_int8(self) -> PackedWeight:
        return pack_int8(self.weight, self.bias)

    @functools.cached_property
    def packed_int4(self) -> PackedWeight:
        return pack_int4(self.weight, self.bias, group=self.int4_group)


@dataclass(frozen=True)
class LinearPath:
    """A way to run a linear layer.

    name: e.g. "cpp-int8-avx2". mode: the --quantization it belongs to ("none", "int8",
    "int4", "auto"; ``candidates`` says which modes offer it). row_invariant: a row's output
    never depends on the other rows of the call. quantizes_activations: needs SmoothQuant'd
    weights. bind: builds the callable. problem: why the path cannot run here (None when it
    can). native: the format of a checkpoint's own blocks it runs ("q4_1", "q8_0", "q4_k",
    "i8_k", "q6_k", "split"; it serves only layers that have them), or None (any layer). min_rows:
    offered for calls of at least this many rows. error_bound: its own relative error bound (None: the mode's).
    activation_bits: what x is rounded to before the product (32: fp32, as given).
    rounds_weights: it rounds the weights themselves (bf16): offered to a layer that has a
    checkpoint's own blocks only where 16-bit compute is allowed for them (``choice.class_paths``'
    round_blocks: the auto modes on a CPU that computes bf16 in hardware, its bf16 copy of
    the weights fitting in memory, subject to the quality gate, ``quality_gate``).
    writes_weight: every call writes the whole weight dequantized to fp32 (N x K x 4 bytes,
    then read back by ``F.linear``): part of its time is that memory traffic, so it is
    timed on a sample whose fp32 copy exceeds the last-level cache (``choice``).
    """

    name: str
    mode: str
    row_invariant: bool
    quantizes_activations: bool
    bind: Callable[[LayerWeights], Callable[[torch.Tensor], torch.Tensor]]
    problem: Callable[[], str | None]
    native: str | None = None
    min_rows: int = 1
    error_bound: float | None = None
    activation_bits: int = 32
    rounds_weights: bool = False
    writes_weight: bool = False

    def accepts(self, lw: LayerWeights) -> bool:
        """Whether this path can serve the layer: a native path needs its blocks (whether a
        path that rounds the weights is offered to a layer with blocks is
        ``choice.class_paths``' decision)."""
        return self.native is None or lw.native_fmt == self.native

    def bound(self, mode: str) -> float:
        """The relative error bound the path must meet in `mode`."""
        return self.error_bound if self.error_bound is not None else ERROR_BOUNDS[mode]

    @property
    def numerics(self) -> str:
        """Paths with the same numerics give bit-identical outputs (our C++ builds of one
        format); the batch-invariant mode may switch only between those."""
        return self.name.rsplit("-", 1)[0] if self.name.startswith("cpp-") else self.name


def _fbgemm_problem() -> str | None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm engine (x86-64 only)"
    return None


def _isa_problem(isa: str) -> Callable[[], str | None]:
    return lambda: qlc.isa_problem(isa)


def _dequant_isa() -> str | None:
    isas = qlc.available_isas()
    return isas[0] if isas else None


def _dequant_problem() -> str | None:
    return None if _dequant_isa() else "no C++ build of the quantized linear kernel runs here"


_PACKED = {"f32": "packed_f32", "int8": "packed_int8", "int4": "packed_int4",
           "q4_1": "packed_native", "q8_0": "packed_native", "q4_k": "packed_native",
           "i8_k": "packed_native", "q6_k": "packed_native", "q5_k": "packed_native",
           "q4_0": "packed_native", "split": "packed_native"}
_NATIVE = ("q4_1", "q4_0", "q8_0", "q4_k", "i8_k", "q6_k", "q5_k", "split")
"""Formats of a checkpoint's own blocks (``native.fmt``) that have paths."""
_ACT_NATIVE = ("q4_1", "q4_0", "q8_0")
"""Those with int8 activation variants (x8)."""
_ACT16_NATIVE = _NATIVE
"""Those with int16 activation variants (x16): all."""


def _cpp_act8(fmt: str, isa: str) -> LinearPath:
    """Our kernel over the checkpoint's own q4_1 / q8_0 blocks with x quantized to int8 per
    row and group of 32 (``kernels.quant_pack.quantize_activations``), as llama.cpp's CPU
    dot products: the same weights, int8 rounding of x, under ACT8_ERROR_BOUND. Offered in
    auto-a8 only: it is not auto's fp32 product (see ACT8_ERROR_BOUND)."""
    return LinearPath(f"cpp-{fmt}x8-{isa}", "auto-a8", True, False,
                      lambda lw: CppLinear(with_int8_activations(lw.packed_native), isa),
                      _isa_problem(isa), native=fmt, error_bound=ACT8_ERROR_BOUND,
                      activation_bits=8)


AMX_MIN_ROWS = 16
"""The rows from which the ``amx`` build's x16 calls run on its tiles (``kAmxMinRows``, a
tile's rows); below, that build runs the avx512 code, so its paths are timed from here on."""


def _cpp_act16(fmt: str, isa: str) -> LinearPath:
    """Our kernel over the checkpoint's own q4_1 / q8_0 / q4_k / i8_k / q6_k blocks with x quantized
    to int16 per row and group of 32 (``quantize_activations(..., levels=32767)``),
    multiplied with ``vpmaddwd`` / ``vpdpwssd`` (or on the ``amx`` build's AMX-INT8 tiles, from
    AMX_MIN_ROWS rows: the same bits): the same weights, under ACT16_ERROR_BOUND. Offered in
    auto and auto-a8."""
    return LinearPath(f"cpp-{fmt}x16-{isa}", "auto", True, False,
                      lambda lw: CppLinear(per_part(with_int16_activations, lw.packed_native),
                                           isa),
                      _isa_problem(isa), native=fmt, error_bound=ACT16_ERROR_BOUND,
                      activation_bits=16,
                      min_rows=AMX_MIN_ROWS if isa in qlc.ACT16_VARIANTS else 1)


def _cpp(fmt: str, isa: str) -> LinearPath:
    attr = _PACKED[fmt]
    mode = "none" if fmt == "f32" else "auto" if fmt in _NATIVE else fmt
    return LinearPath(f"cpp-{fmt}-{isa}", mode, True, False,
                      lambda lw: CppLinear(getattr(lw, attr), isa), _isa_problem(isa),
                      native=fmt if fmt in _NATIVE else None)


def _dequant(fmt: str) -> LinearPath:
    attr = _PACKED[fmt]
    return LinearPath(f"{fmt}-dequant-mm", "auto" if fmt in _NATIVE else fmt, False, False,
                      lambda lw: DequantLinear(getattr(lw, attr), _dequant_isa() or "avx2"),
                      _dequant_problem, native=fmt if fmt in _NATIVE else None,
                      min_rows=DEQUANT_MIN_ROWS, writes_weight=True)


PATHS: dict[str, LinearPath] = {p.name: p for p in [
    LinearPath("fp32", "none", False, False, lambda lw: DenseLinear(lw.weight, lw.bias),
               lambda: None),
    *[_cpp("f32", isa) for isa in qlc.VARIANTS],
    LinearPath("fbgemm", "int8", False, True, lambda lw: Int8Linear(lw.weight, lw.bias),
               _fbgemm_problem),
    LinearPath("int_mm", "int8", False, True,
               lambda lw: Int8Linear(lw.weight, lw.bias, per_token=True), _fbgemm_problem),
    *[_cpp("int8", isa) for isa in qlc.VARIANTS],
    _dequant("int8"),
    *[_cpp("int4", isa) for isa in qlc.VARIANTS],
    _dequant("int4"),
    *[_cpp("q4_1", isa) for isa in qlc.VARIANTS],
    _dequant("q4_1"),
    *[_cpp("q4_0", isa) for isa in qlc.VARIANTS],
    _dequant("q4_0"),
    *[_cpp("q8_0", isa) for isa in qlc.VARIANTS],
    _dequant("q8_0"),
    *[_cpp("q4_k", isa) for isa in qlc.VARIANTS],
    _dequant("q4_k"),
    *[_cpp("i8_k", isa) for isa in qlc.VARIANTS],
    _dequant("i8_k"),
    *[_cpp("q6_k", isa) for isa in qlc.VARIANTS],
    _dequant("q6_k"),
    *[_cpp("q5_k", isa) for isa in qlc.VARIANTS],
    _dequant("q5_k"),
    *[_cpp("split", isa) for isa in qlc.VARIANTS],
    _dequant("split"),
    *[_cpp_act8(fmt, isa) for fmt in _ACT_NATIVE for isa in qlc.VARIANTS],
    *[_cpp_act16(fmt, isa) for fmt in _ACT16_NATIVE
      for isa in (*qlc.ACT16_VARIANTS, *qlc.VARIANTS)],
    LinearPath("bf16", "auto", False, False, lambda lw: BF16Linear(lw.weight, lw.bias),
               lambda: None, min_rows=BF16_MIN_ROWS, error_bound=BF16_ERROR_BOUND,
               rounds_weights=True),
]}
"""Every path, in order of preference when two measure the same."""


def candidates(mode: str, batch_invariant: bool, bf16: bool = True) -> list[LinearPath]:
    """The paths that may serve a layer in `mode` ("none", "int8", "int4", "auto",
    "auto-a8": auto's candidates plus the int8-activation ``x8`` paths).

    int8 mode keeps ``fp32`` among its candidates: --quantization int8 is never slower
    than fp32. auto: every weight-only path over the checkpoint's own weights (``fp32``,
    ``cpp-f32-*``, the native q4_1 / q8_0 / q4_k / i8_k / q6_k paths; each layer takes those that
    accept it),
    the int16-activation ``x16`` paths over those blocks, and bf16 for layers without blocks;
    never int8 activations. int8 and int4 offer bf16 too; none never. In the auto modes bf16
    is offered only where the CPU computes it in hardware (``bf16_hardware``: emulated, it is
    4-6x slower than fp32) and `bf16` is True (``--cpu-bf16-compute auto``); which layers
    and buckets it may serve there is ``choice.class_paths``' and the quality gate's
    (``quality_gate``) decision.
    batch_invariant: only row-invariant paths of one numerics per layer (our C++ kernels of
    the mode's format, fp32 for "none"; in auto the layer's native format, else f32), so
    that a row's output is the same bits whatever else shares the step.

    ``$CONVEYOR_LINEAR_PATHS`` (a comma list of path names), when set, keeps only those
    (e.g. ``fp32,cpp-int8-avx2`` to see what an AVX2-only CPU's kernels give here).

    Raises ValueError for an unknown mode, or an unknown name in $CONVEYOR_LINEAR_PATHS.
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    only = [n.strip() for n in os.environ.get("CONVEYOR_LINEAR_PATHS", "").split(",") if n.strip()]
    unknown = [n for n in only if n not in PATHS]
    if unknown:
        raise ValueError(f"CONVEYOR_LINEAR_PATHS names unknown paths {unknown}; "
                         f"known: {', '.join(PATHS)}")
    found = _candidates(mode, batch_invariant)
    if mode in ("auto", "auto-a8") and not (bf16 and bf16_hardware()):
        found = [p for p in found if not p.rounds_weights]
    return [p for p in found if p.name in only] if only else found


def _candidates(mode: str, batch_invariant: bool) -> list[LinearPath]:
    if batch_invariant:
        if mode in ("auto", "auto-a8"):  # the native format first (one numerics a layer)
            native = [p for p in PATHS.values() if p.native is not None and p.row_invariant
                      and p.mode in ("auto", mode) and p.activation_bits != 16]
            native.sort(key=lambda p: p.mode != mode)  # auto-a8: its x8 paths first
            return native + [p for p in PATHS.values() if p.name.startswith("cpp-f32-")]
        fmt = "f32" if mode == "none" else mode
        return [p for p in PATHS.values() if p.name.startswith(f"cpp-{fmt}-")]
    if mode == "none":
        return [PATHS["fp32"]]
    if mode in ("auto", "auto-a8"):
        return [p for p in PATHS.values() if p.mode in ("none", "auto", mode)]
    if mode == "int8":
        return [PATHS["fp32"]] + [p for p in PATHS.values() if p.mode == "int8"] + [PATHS["bf16"]]
    return [p for p in PATHS.values() if p.mode == "int4"] + [PATHS["bf16"]]


def bf16_hardware() -> str | None:
    """What computes bf16 matmuls in hardware here: "AMX" (amx_bf16: Intel Sapphire Rapids
    on), "AVX512-BF16" (avx512_bf16: Intel Cooper Lake, AMD Zen 4 on), or None (torch
    emulates bf16 in fp32: AVX2-only and plain AVX-512 CPUs)."""
    from kernels.cpu_build import cpu_flags

    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AMX"
    return "AVX512-BF16" if "avx512_bf16" in flags else None


def machine_note() -> str:
    """One line on what decides the paths here (the int8 ISA in force, bf16 hardware, C++
    builds)."""
    isas = qlc.available_isas()
    tiles = [isa for isa in qlc.ACT16_VARIANTS if qlc.isa_problem(isa) is None]
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"{int8_isa().note()}; bf16 {bf16_hardware() or 'emulated (no AMX / AVX512-BF16)'}; "
            f"C++ builds: {', '.join(isas) if isas else 'none'}"
            f"{''.join(f', {t} (x16 from {AMX_MIN_ROWS} rows)' for t in tiles)}")
