"""The fused CPU forward: every decoder layer of a step in one native call.

On a CPU a one-sequence decode step is mostly per-op dispatch from Python (about 15
torch or ctypes calls a layer, each tens of microseconds, around linear layers that are
the only real work). ``FusedForward`` runs the whole forward -- embedding, every layer's
RMSNorm, QKV, rotary, K/V store, paged attention, o-proj, residual, RMSNorm, gate_up,
SiLU x mul, down, and the final norm and LM head at the sampling rows -- in one call of
``kernels/csrc/decode_forward_cpu.cpp``. It calls the same C++ kernels the unfused path
calls, by pointer: each layer's linear in the build and packed format the linear plan
chose (``kernels.quant_linear_cpu``), and the paged decode attention
(``kernels.decode_attention_cpu``). llama.cpp's CPU backend works the same way (one
graph, no interpreter between ops).

Which rows it serves is the caller's plan: decode rows (one query token each) or, in the
batch-invariant mode, prefill rows as decodes over their own causal prefix
(``kernels.paged_attention_cpu.KernelDecodes``).

Built with g++ on first use (``kernels.cpu_build``, ``-march=native``; -ffast-math lets
SiLU's exp vectorise, as in the decode attention kernel: see CXX_FLAGS), cached per machine.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import decode_attention_cpu as dac
from kernels import quant_linear_cpu as qlc
from kernels.cpu_attention_io import KV_DTYPE_CODES
from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary
from kernels.packed_parts import AnyPacked, PackedParts

SOURCE = Path(__file__).parent / "csrc" / "decode_forward_cpu.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
"""Compile flags. The whole of -ffast-math, -ffinite-math-only included: without it GCC does
not call glibc's vector exp (libmvec's ``_ZGVdN8v_expf`` on AVX2) and SiLU ran one scalar
``expf`` a value. Measured on a 2-core Zen 3 (AVX2), ctx 300: the small ops of a 1-row step
0.20-0.22 -> 0.07-0.12 ms, of an 8-row step 0.87-0.93 -> 0.39-0.42 ms. Under finite-math an
overflowing exp is not a clean inf, so SiLU clamps its argument (silu_mul_row). The file tests
no value for NaN or infinity, and a NaN still propagates through the arithmetic to the
logits, where the sampler's checks (built without -ffast-math) fail the row."""

__all__ = ["FusedForward", "FusedLayer", "KernelBuildError", "LIBRARY", "build_problem",
           "narrow_kv"]

_i64, _p, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("fn", _p), ("fmt", _i64), ("in_features", _i64), ("out_features", _i64),
                ("padded_out", _i64), ("group", _i64), ("w", _p), ("scale", _p),
                ("minv", _p), ("bias", _p), ("sup_scale", _p), ("sup_min", _p),
                ("super_group", _i64), ("next", _p)]


# ConveyorModel::kv_kind: the caches' element type, by the attention kernels' codes
_KV_KINDS = KV_DTYPE_CODES


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("ln1", _p), ("ln2", _p), ("kv", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("vocab", _i64), ("max_position", _i64), ("num_blocks", _i64),
                ("block_size", _i64), ("eps", _f32), ("scale", _f32), ("kv_kind", _i64),
                ("layers", _p),
                ("embed", _p), ("norm", _p), ("cos", _p), ("sin", _p), ("lm_head", _Linear),
                ("attention", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("ids", _p), ("positions", _p), ("slots", _p), ("tables", _p),
                ("table_stride", _i64), ("table_width", _i64), ("seq_lens", _p),
                ("logits_rows", _p), ("num_logits", _i64), ("logits", _p),
                ("num_threads", ctypes.c_int), ("embedded", _p)]


def _setup(lib: ctypes.CDLL) -> None:
    lib.conveyor_decode_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.conveyor_decode_forward.restype = ctypes.c_int
    # the row ops of the unfused forward (kernels.rowwise_cpu)
    i32 = ctypes.c_int
    for name, args in (
            ("conveyor_rms_norm_rows", [_p, _i64, _p, _f32, _i64, _i64, _p, _i64, i32]),
            ("conveyor_add_rms_norm_rows", [_p, _i64, _p, _i64, _p, _f32, _i64, _i64, _p, _i64,
                                            i32]),
            ("conveyor_rotate_rows", [_p, _i64, _i64, _i64, _p, _p, _i64, i32]),
            ("conveyor_silu_mul_rows", [_p, _i64, _i64, _i64, _p, _i64, i32]),
            ("conveyor_narrow_kv", [_p, _p, _i64, _i64])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32


LIBRARY = KernelLibrary(CppKernel("decode_forward_cpu", SOURCE, CXX_FLAGS), _setup)
"""The fused forward's library (and the unfused forward's row ops, ``kernels.rowwise_cpu``),
built and loaded on first use."""


def narrow_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ([n] float32, contiguous, CPU) rounded to dtype (float16 or bfloat16) as the fused
    forward rounds the K/V it stores in a 16-bit cache (``kernels/csrc/half.h``); for tests,
    which hold it to torch's ``x.to(dtype)``. Raises ValueError for another dtype or input,
    KernelBuildError where the library does not build."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"narrow_kv rounds to float16 or bfloat16, not {dtype}")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError("narrow_kv needs a contiguous 1-D float32 CPU tensor")
    out = torch.empty(x.shape, dtype=dtype)
    if LIBRARY.load().conveyor_narrow_kv(x.data_ptr(), out.data_ptr(), x.numel(),
                                         _KV_KINDS[dtype]) != 0:
        raise ValueError("conveyor_narrow_kv refused its arguments")
    return out


def build_problem() -> str | None:
    """Why the fused forward cannot run here (this library, the decode attention kernel or
    no build of the linear kernel), or None when it can. Builds them on the first call."""
    for problem in (LIBRARY.problem(), dac.build_problem()):
        if problem is not None:
            return problem
    if not qlc.available_isas():
        return "no build of the C++ linear kernel runs here"
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(packed: AnyPacked, isa: str, keep: list[_Linear]) -> _Linear:
    """The kernel's struct for `packed`; a split weight's later parts are chained by `next`
    (their structs appended to `keep`, which must outlive every call)."""
    if isinstance(packed, PackedParts):
        tail = None
        for part in reversed(packed.parts[1:]):
            node = _linear(part, isa, keep)
            node.next = None if tail is None else ctypes.addressof(tail)
            keep.append(node)
            tail = node
        head = _linear(packed.parts[0], isa, keep)
        head.next = ctypes.addressof(tail)
        return head
    return _Linear(qlc.entry_point(isa), qlc.format_code(packed.fmt), packed.in_features,
                   packed.out_features, packed.padded_out, packed.group, packed.data.data_ptr(),
                   _ptr(packed.scale), _ptr(packed.minv), _ptr(packed.bias),
                   _ptr(packed.super_scale), _ptr(packed.super_min), packed.super_group)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights for the fused forward: (packed weight, isa) per linear (a
    split weight, ``kernels.packed_parts``, is called part by part), the norms' weights [H]
    and the layer's KV cache [2, num_blocks, block_size, Hkv, D]."""

    qkv: tuple[AnyPacked, str]
    o: tuple[AnyPacked, str]
    gate_up: tuple[AnyPacked, str]
    down: tuple[AnyPacked, str]
    ln1: torch.Tensor
    ln2: torch.Tensor
    kv: torch.Tensor


class FusedForward:
    """A model's whole forward over M rows in one call (see the module docstring).

    Args:
        layers: the decoder layers, in order.
        lm_head: (packed weight, isa) of the LM head.
        embed: [V, H] float32 embedding, or a callable with a `shape` (V, H) that maps
            ids [M] int64 to their rows [M, H] float32 (``BlockEmbedding``), called per step;
            norm: [H] final RMSNorm weight.
        Each layer's kv: [2, num_blocks, block_size, Hkv, D], float32, float16 or bfloat16 (the
            model's KV cache; all layers one dtype), contiguous.
        cos, sin: [max_position, D/2] float32 rotary tables (rotate-half convention).
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D. eps: RMSNorm epsilon.
        scale: softmax scale. intermediate: I, half of gate_up's outputs.

    Every tensor is kept referenced here; all must be contiguous float32 on the CPU but
    the caches.

    Raises:
        ValueError: a shape, dtype or layout that does not fit the above.
        KernelBuildError: a kernel it needs does not build here.
    """

    def __init__(self, layers: Sequence[FusedLayer], lm_head: tuple[AnyPacked, str],
                 embed: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 *, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float) -> None:
        vocab, hidden = embed.shape
        kv = layers[0].kv
        # a callable embedding (a GGUF file's blocks) looks rows up per call
        self._embed_rows = None if isinstance(embed, torch.Tensor) else embed
        tensors = ([embed] if self._embed_rows is None else []) + [norm, cos, sin] + \
            [t for L in layers for t in (L.ln1, L.ln2)]
        caches = [L.kv for L in layers]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
               for t in tensors):
            raise ValueError("the fused forward needs contiguous float32 CPU tensors")
        if any(t.dtype != kv.dtype or t.device.type != "cpu" or not t.is_contiguous()
               for t in caches) or kv.dtype not in dac.KV_DTYPES:
            raise ValueError(f"the fused forward needs contiguous CPU KV caches of one dtype in "
                             f"{dac.KV_DTYPES}, layer 0's is {kv.dtype}")
        if kv.dim() != 5 or kv.shape[0] != 2 or tuple(kv.shape[3:]) != (num_kv_heads, head_dim):
            raise ValueError(f"KV cache {tuple(kv.shape)} is not [2, blocks, block_size, "
                             f"{num_kv_heads}, {head_dim}]")
        if cos.shape != sin.shape or cos.shape[1] * 2 != head_dim:
            raise ValueError(f"rotary tables {tuple(cos.shape)} do not fit head_dim {head_dim}")
        if not dac.supports(torch.float32, num_heads, num_kv_heads, head_dim, kv.dtype):
            raise ValueError(f"the decode attention kernel does not cover {num_heads}/"
                             f"{num_kv_heads} heads of {head_dim}")
        qkv_out = (num_heads + 2 * num_kv_heads) * head_dim
        for i, L in enumerate(layers):
            shapes = {"qkv": (L.qkv[0], hidden, qkv_out),
                      "o": (L.o[0], num_heads * head_dim, hidden),
                      "gate_up": (L.gate_up[0], hidden, 2 * intermediate),
                      "down": (L.down[0], intermediate, hidden)}
            for name, (p, k, n) in shapes.items():
                if (p.in_features, p.out_features) != (k, n):
                    raise ValueError(f"layer {i} {name}: [{p.out_features}, {p.in_features}], "
                                     f"expected [{n}, {k}]")
            if L.kv.shape != kv.shape:
                raise ValueError(f"layer {i}'s KV cache {tuple(L.kv.shape)} differs from layer 0's")
        if (lm_head[0].in_features, lm_head[0].out_features) != (hidden, vocab):
            raise ValueError(f"LM head [{lm_head[0].out_features}, {lm_head[0].in_features}] "
                             f"does not fit [{vocab}, {hidden}]")
        self._lib = LIBRARY.load()
        dac.load_kernel()
        tails: list[_Linear] = []  # split weights' later parts, chained by pointer
        self._keep = (layers, lm_head, tensors, caches, tails)
        self._layers = (_Layer * len(layers))(*[
            _Layer(_linear(*L.qkv, tails), _linear(*L.o, tails), _linear(*L.gate_up, tails),
                   _linear(*L.down, tails),
                   L.ln1.data_ptr(), L.ln2.data_ptr(), L.kv.data_ptr()) for L in layers])
        attention = ctypes.cast(dac.entry_point(), _p).value
        self._model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim,
                             intermediate, vocab, cos.shape[0], kv.shape[1], kv.shape[2],
                             eps, scale, _KV_KINDS[kv.dtype],
                             ctypes.addressof(self._layers),
                             None if self._embed_rows is not None else embed.data_ptr(),
                             norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             _linear(*lm_head, tails), attention)
        self.vocab_size = vocab

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """One step's forward.

        Args:
            input_ids, positions, slot_mapping: [M] int64 contiguous (each row's token, its
                position, the cache slot its K/V goes to).
            block_tables: [M, max_blocks] int64 with unit stride in the last dim: row m's
                sequence's blocks. seq_lens: [M] int64: the tokens row m attends to (its own
                included: position + 1 for a decode).
            logits_indices: [S] int64, the rows that sample.

        Returns:
            logits [S, V] float32.

        Raises:
            ValueError: an id, position, slot, block id or length out of range (nothing is
                written to the cache for ids, positions and slots), or a tensor not as above.
        """
        M = input_ids.shape[0]
        ts = (input_ids, positions, slot_mapping, seq_lens, logits_indices, block_tables)
        if (any(t.dtype != torch.int64 or t.device.type != "cpu" for t in ts)
                or any(not t.is_contiguous() for t in ts[:5]) or positions.shape != (M,)
                or slot_mapping.shape != (M,) or seq_lens.shape != (M,)
                or block_tables.dim() != 2 or block_tables.shape[0] != M
                or block_tables.stride(1) != 1 or logits_indices.dim() != 1):
            raise ValueError("fused forward: ids, positions, slots, seq_lens [M], logits_indices "
                             "[S] contiguous int64 and block_tables [M, max_blocks] int64 on "
                             "the CPU expected")
        S = logits_indices.shape[0]
        logits = torch.empty(S, self.vocab_size, dtype=torch.float32)
        if M == 0:
            return logits
        if self._embed_rows is not None:  # looked up here: the kernel copies these rows
            if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size:
                raise ValueError(_error(2))
            embedded = self._embed_rows(input_ids).contiguous()
        step = _Step(M, input_ids.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                     block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
                     seq_lens.data_ptr(), logits_indices.data_ptr(), S, logits.data_ptr(),
                     torch.get_num_threads(),
                     None if self._embed_rows is None else embedded.data_ptr())
        rc = self._lib.conveyor_decode_forward(ctypes.byref(self._model), ctypes.byref(step))
        if rc != 0:
            raise ValueError(_error(rc))
        return logits


def _error(rc: int) -> str:
    if rc >= 20:
        return f"fused forward: a linear kernel rejected its arguments (code {rc - 20})"
    if rc >= 10:
        return "fused forward: " + dac.kernel_error(rc - 10)
    return {1: "fused forward: a non-positive size or an unsupported head layout",
            2: "fused forward: a token id or position out of range",
            3: "fused forward: a slot or logits row out of range"}.get(rc, f"fused forward error {rc}")
