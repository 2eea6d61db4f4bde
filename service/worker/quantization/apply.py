"""Put a model's linear layers on the kernels chosen by measurement (start-up, once)."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from service.worker.quantization.choice import choose_plan
from service.worker.quantization.gate_cache import (gate_cache_key, load_verdict, refused_before,
                                                    remember_refusal, store_verdict)
from service.worker.quantization.paths import (PATHS, BF16Linear, bf16_hardware, candidates,
                                               machine_note)
from service.worker.quantization.plan import BUCKETS, DispatchLinear, LinearPlan, bucket_rows
from service.worker.quantization.quality_gate import (GateResult, Score, apply_verdict,
                                                      bf16_buckets, run_gate)

from service.worker.gguf_weights import DENSE_TYPES

if TYPE_CHECKING:
    from service.worker.gguf_weights import BlockWeight, GGUFLinearWeights
    from service.worker.model import LlamaModel

log = logging.getLogger(__name__)
CLASSES = ("qkv", "o", "gate_up", "down")


def _dense_weight(model: LlamaModel, layer: int | None, cls: str) -> torch.Tensor:
    lin = model.lm_head if layer is None else getattr(model.layers[layer], cls)
    return lin.weight  # type: ignore[attr-defined]


def verified_natives(model: LlamaModel, gguf: GGUFLinearWeights
                     ) -> dict[tuple[int | None, str], BlockWeight]:
    """The GGUF file's native layers whose dequantization equals the model's dense weight
    (transformers' dequantized fp32, the oracle's) bit for bit; a layer that does not (a
    tensor mapping we got wrong) is logged and served from the dense weight."""
    ok: dict[tuple[int | None, str], BlockWeight] = {}
    for key, blocks in gguf.native.items():
        if torch.equal(blocks.dequantize(), _dense_weight(model, *key)):
            ok[key] = blocks
        else:
            log.warning("quantization auto: layer %s %s's GGUF blocks (%s) do not give "
                        "transformers' weights; serving it dequantized", key[0], key[1],
                        "/".join(blocks.gguf_types))
    log_dequantized(gguf)
    return ok


def log_dequantized(gguf: GGUFLinearWeights) -> None:
    """One warning per GGUF block type that no kernel of ours reproduces: the layers it
    makes be served from dequantized fp32 weights, and the memory that costs beyond the
    file's bytes."""
    by_type: dict[str, list[tuple[int | None, str]]] = {}
    for key, blocks in gguf.layers.items():
        if blocks.fmt is None:
            for t in sorted(set(blocks.gguf_types) - set(DENSE_TYPES)):
                by_type.setdefault(t, []).append(key)
    for gguf_type, keys in sorted(by_type.items()):
        extra = sum(4 * gguf.layers[k].out_features * gguf.layers[k].in_features
                    - gguf.layers[k].file_bytes for k in keys)
        names = ", ".join("lm_head" if i is None else f"{i}.{c}" for i, c in keys[:6])
        more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
        log.warning("quantization auto: GGUF block type %s has no kernel of ours that "
                    "reproduces it: %d linear layer(s) (%s%s) served dequantized (fp32 "
                    "weights), %.1f MB more than the file's blocks", gguf_type, len(keys),
                    names, more, extra / 1e6)


def served_formats(model: LlamaModel,
                   natives: Mapping[tuple[int | None, str], BlockWeight]) -> str:
    """What the model's linear layers serve one-row calls from, per weight format with the
    number of linear layers: e.g. "q4_1 (GGUF Q4_1): 120 layers; q8_0 (GGUF Q8_0): 1 layer"."""
    counts: Counter[str] = Counter()
    keys = [(i, c) for i in range(model.num_layers) for c in CLASSES] + [(None, "lm_head")]
    for layer, cls in keys:
        lin = model.lm_head if layer is None else getattr(model.layers[layer], cls)
        lin = lin.fns[0] if isinstance(lin, DispatchLinear) else lin
        packed = getattr(lin, "packed", None)
        fmt = (packed.fmt if packed.fmt != "f32" else "fp32") if packed is not None else \
            "bf16" if isinstance(lin, BF16Linear) else "fp32"
        blocks = natives.get((layer, cls))
        if blocks is not None and fmt == blocks.fmt:
            fmt += f" (GGUF {'/'.join(sorted(set(blocks.gguf_types)))})"
        counts[fmt] += 1
    return "; ".join(f"{k}: {n} layer{'s' if n != 1 else ''}" for k, n in counts.items())


def model_linears(model: LlamaModel) -> list[tuple[str, object]]:
    """(class, Linear) of every linear layer: the decoder layers' in order, then the LM
    head."""
    out: list[tuple[str, object]] = [(c, getattr(layer, c)) for layer in model.layers
                                     for c in CLASSES]
    return out + [("lm_head", model.lm_head)]


def sixteen_bit_summary(linears: Sequence[tuple[str, object]]) -> tuple[str, int]:
    """(which buckets of which classes run bf16, e.g. "rows 181+: qkv, o, gate_up, down",
    or "" for none; bytes of the distinct bf16 weights held)."""
    by_bucket: dict[int, list[str]] = {}
    held: dict[int, int] = {}
    for cls, lin in linears:
        fns, names = ((lin.fns, lin.names) if isinstance(lin, DispatchLinear)
                      else ([lin] * len(BUCKETS), ("",) * len(BUCKETS)))
        for b, (fn, name) in enumerate(zip(fns, names)):
            if isinstance(fn, BF16Linear):
                held[id(fn)] = fn.weight.numel() * fn.weight.element_size()
                if cls not in by_bucket.setdefault(b, []):
                    by_bucket[b].append(cls)
    text = "; ".join(f"rows {bucket_rows(b)}: {', '.join(c)}"
                     for b, c in sorted(by_bucket.items()))
    return text, sum(held.values())


@torch.inference_mode()
def apply_linear_plan(model: LlamaModel, mode: str, batch_invariant: bool,
                      calibrate: Callable[[], list],
                      gguf: GGUFLinearWeights | None = None,
                      fused_rows: int = 0, *, bf16: bool = True, round_blocks: bool = False,
                      gate: Callable[[], tuple[Score, int]] | None = None,
                      gate_model: str | None = None) -> LinearPlan:
    """Choose each linear layer's kernel by measurement (``choose_plan``; timings cached per
    machine), log the table, calibrate SmoothQuant where an activation-quantizing path
    serves (``calibrate()``: per-layer AmaxObservers), and replace the model's linear layers.

    mode: "none" (fp32 weights; batch invariance only), "int8", "int4", "auto" (the
        checkpoint's own weights: `gguf`'s native blocks where given and verified, else
        the dense weights, on the fastest path measured: fp32 activations, or int16 ones
        on the blocks, and bf16 for many-row calls where `bf16` allows it, the CPU computes
        it in hardware and the quality gate passes) or "auto-a8" (auto's weights,
        int8-activation paths among the candidates).
    gguf: auto on a GGUF file: its layers in their own block formats.
    fused_rows: row buckets up to this size prefer C++ kernels the fused forward can call
        (``choose_plan``); 0 where no step will be fused.
    bf16: the auto modes may offer bf16 at all (``--cpu-bf16-compute``; ``candidates``).
    round_blocks: the decoder layers' GGUF blocks may also be served by bf16 over a copy
        dequantized once to bf16 (16 bits a weight: the caller checked that it fits in
        memory). Never the LM head's: it sees one row per sampling sequence.
    gate: in the auto modes where bf16 was chosen for some bucket, () -> (the quality
        gate's score, its text's tokens) (``quality_gate.run_gate``); None: no bf16 in the
        auto modes (nothing can vouch for it).
    gate_model: the served model's path: the gate's verdict is kept on disk for it and this
        machine (``gate_cache``) and a later start-up reuses it; None: not kept.

    Raises:
        ValueError: no kernel of the mode can run here (int4 or batch-invariant without the
            C++ kernels).
    """
    blocks_only = model.blocks_only
    if blocks_only and (gguf is None or mode not in ("auto", "auto-a8")):
        raise ValueError("a model read as a GGUF file's blocks is served in quantization "
                         "auto or auto-a8, with its blocks")
    if blocks_only:  # nothing dense to check against: tests check the blocks (the oracle)
        natives = dict(gguf.native)  # type: ignore[union-attr]
        log_dequantized(gguf)  # type: ignore[arg-type]
    else:
        natives = (verified_natives(model, gguf) if gguf is not None
                   and mode in ("auto", "auto-a8") else {})
    first = {c: natives[(0, c)] for c in CLASSES if (0, c) in natives}
    if (None, "lm_head") in natives:
        first["lm_head"] = natives[(None, "lm_head")]
    auto = mode in ("auto", "auto-a8")
    # a model whose gate refused bf16 on this machine before is not offered it again: no
    # bf16 copy of its blocks, no timing of that path (gate_cache.refused_before)
    before = refused_before(gate_model) if auto and bf16 and gate is not None and gate_model \
        else None
    if before is not None:
        bf16, round_blocks = False, False
    plan = choose_plan(model.linear_weights(),
                       candidates(mode, batch_invariant, bf16=bf16 and gate is not None),
                       mode, batch_invariant, natives=first, fused_rows=fused_rows,
                       native_only=blocks_only,
                       round_blocks=frozenset(CLASSES) if round_blocks and auto else frozenset())
    plan = dataclasses.replace(plan, natives=natives)
    # the whole timing table is a few KB: --log-level debug shows it, info the summary below
    log.debug("%s\n  (%s)", plan.table(), machine_note())
    if mode == "int8" and plan.all_fp32():
        log.warning("--quantization int8: no int8 kernel beats fp32 on this CPU (%s); "
                    "serving fp32", machine_note())
    smooth = plan.smoothed_classes()
    observed = calibrate() if smooth else None
    model.quantize(plan.make_linear, None if mode == "none" else mode, observed, smooth)
    if auto:
        plan = _gate_16bit(model, plan, gate, bf16, round_blocks, blocks_only, gate_model,
                           before)
    log.info("linear layers: %s (SmoothQuant on %s; %s)", plan.summary(),
             ", ".join(sorted(smooth)) or "none", machine_note())
    if auto:
        log.info(f"quantization {mode}: one-row calls (decode) read %s",
                 served_formats(model, natives))
    return plan.without_natives()


def _scored_or_cached(linears: list[object], gate: Callable[[], tuple[Score, int]],
                      gate_model: str | None) -> list[GateResult]:
    """``run_gate``'s results, from the disk cache where a verdict for this model, machine
    and plan is stored (its refusals applied again), else scored now and stored."""
    score, tokens = gate()
    key = gate_cache_key(gate_model, linears, tokens) if gate_model else None
    cached = load_verdict(key) if key else None
    if cached is not None:
        results, unreachable = cached
        apply_verdict(linears, results, unreachable)
        remember_refusal(gate_model, results)  # type: ignore[arg-type]
        log.info("quality gate: the verdict stored for this model and machine (%s), not "
                 "scored again", "; ".join(r.describe() for r in results) or "no bucket tested")
        return results
    before = bf16_buckets(linears)
    results = run_gate(linears, score, tokens)
    if key is not None:
        tested = {r.bucket for r in results}
        store_verdict(key, results, [b for b in before if b not in tested])
    if gate_model:
        remember_refusal(gate_model, results)
    return results


def _gate_16bit(model: LlamaModel, plan: LinearPlan,
                gate: Callable[[], tuple[Score, int]] | None, bf16: bool,
                round_blocks: bool, blocks_only: bool, gate_model: str | None = None,
                refused: str | None = None) -> LinearPlan:
    """Run the quality gate where the plan put bf16 on some bucket (``run_gate``; or take
    its verdict from the disk cache, ``gate_cache``, for `gate_model` on this machine), set the
    plan's choices to what the model's layers then run, and log the start-up line on
    16-bit compute: which buckets of which classes use it, the gate's figures, the bf16
    weights' bytes; or why none does."""
    linears = model_linears(model)
    results: list[GateResult] = []
    if gate is not None and any(PATHS[n].rounds_weights for names in plan.choices.values()
                                for n in names):
        results = _scored_or_cached([lin for _, lin in linears], gate, gate_model)
    served: dict[str, tuple[str, ...]] = {}
    for cls, lin in linears:  # the first layer of each class, as the plan's choices
        if cls not in served:
            served[cls] = (lin.names if isinstance(lin, DispatchLinear)
                           else plan.choices[cls])
    plan = dataclasses.replace(plan, choices={c: served.get(c, n)
                                              for c, n in plan.choices.items()})
    where, held = sixteen_bit_summary(linears)
    hw = bf16_hardware()
    gated = "; ".join(r.describe() + (" passed" if r.passes() else " refused")
                      for r in results) if results else ""
    if where:
        log.info("16-bit compute (bf16 F.linear, %s in hardware) for %s; bf16 weights %.1f "
                 "MB%s; quality gate against the exact plan: %s", hw, where, held / 1e6,
                 " (the GGUF blocks dequantized once; the blocks still serve fewer rows)"
                 if blocks_only else "", gated)
        return plan
    why = (f"the quality gate refused it for this model on this machine before ({refused}); "
           "remembered in the kernel cache folder" if refused is not None else
           "--cpu-bf16-compute off" if not bf16 else
           "this CPU emulates bf16 (no AMX or AVX512-BF16)" if hw is None else
           "no quality gate here" if gate is None else
           f"the quality gate refused it ({gated})" if results else
           "the GGUF blocks' bf16 copy would not fit in memory (see the memory line above)"
           if blocks_only and not round_blocks else
           f"{', '.join(str(r) for r in BUCKETS[1:])}-row calls measured faster on the "
           "exact paths")
    log.info("16-bit compute: none (%s)", why)
    return plan
