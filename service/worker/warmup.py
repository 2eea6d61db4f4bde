"""The runner's start-up forwards, before any request runs: the swap and prefill rates the
scheduler's preemption cost model reads, the row buckets' and the decode path's first
calls (their lazy set-up off the first requests), the thread tuner's first probe, and the
forwards that choose the linear kernels (SmoothQuant's calibration, the 16-bit quality
gate's text). Each uses the empty KV cache's first blocks as scratch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from protocol import SamplingParams
from service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from service.worker.quantization import calibration_token_ids
from service.worker.quantization.gate_text import gate_token_ids
from service.worker.quantization.quality_gate import Predictions, Score, predictions

if TYPE_CHECKING:
    from service.worker.model_runner import ModelRunner

__all__ = ["WARMUP_MACS", "WARM_CHUNK_MACS", "warmup_tokens", "decoder_macs_per_token",
           "measure_rates", "warm_buckets", "first_thread_probe", "gate_inputs", "calibrate"]

log = logging.getLogger(__name__)

WARMUP_MACS = 16_000_000_000
"""The start-up prefill steps' budget in multiply-adds of the decoder layers' linear layers:
about 128 tokens of SmolLM2-135M (106 M a token). 128 tokens at the 8B shape took minutes on
2 cores: the thread probe's 16 steps at about 7 GMAC a token, half of them on one thread."""


WARM_CHUNK_MACS = 8 * WARMUP_MACS
"""The most the start-up's two prefill-chunk warm-ups may cost (multiply-adds) where only
our C++ kernels serve: SmolLM2-135M's 2 x 512 tokens fit (109 G), Llama-3.2-1B's do not."""


def warmup_tokens(hf_config: object) -> int:
    """Tokens of the start-up prefill steps (``measure_rates``): as many as WARMUP_MACS
    buys, at most 128, at least 1, a multiple of 16 from 16 on. E.g. SmolLM2-135M 128,
    Llama-3.2-1B 16, Llama-3.2-3B 5, Llama-3.1-8B 2. (Their prefill rate then reads low
    for a big model, which only makes preemption lean to swapping: a CPU swap is a copy.)"""
    tokens = WARMUP_MACS // decoder_macs_per_token(hf_config)
    return max(1, min(128, tokens // 16 * 16 if tokens >= 16 else tokens))


def decoder_macs_per_token(hf_config: object) -> int:
    """Multiply-adds of the decoder layers' linear layers for one token (>= 1)."""
    c = hf_config
    heads, kv = c.num_attention_heads, c.num_key_value_heads  # type: ignore[attr-defined]
    hidden = c.hidden_size  # type: ignore[attr-defined]
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * c.intermediate_size  # type: ignore[attr-defined]
    return max(1, per_layer * c.num_hidden_layers)  # type: ignore[attr-defined]


SWAP_PROBE_BYTES = 32 << 20
"""The swap-rate measurement at start-up copies at most this many bytes of KV blocks each way."""


@torch.inference_mode()
def measure_rates(runner: ModelRunner, prefill_tokens: int | None = None,
                  buckets: bool = True) -> tuple[float, float]:
    """(swap bytes/s, prefill tokens/s) measured on this machine (a few hundred ms), then
    the row buckets' first calls (`warm_buckets`; buckets False leaves them to the first
    requests, as a benchmark of that cost does), two decode steps to warm the decode path
    up, then the thread tuner's first probe on prefill steps of `prefill_tokens`
    (`first_thread_probe`; default ``warmup_tokens``: 128 at SmolLM2-135M's size, fewer
    for bigger models)."""
    if prefill_tokens is None:
        prefill_tokens = warmup_tokens(runner.loaded.hf_config)
    swap_bw = 0.0
    # at most 32 blocks and SWAP_PROBE_BYTES of them: 32 blocks are 23 MB at 135M's shape
    # but 128 MB at 8B's, whose first touches and copies took 8.8 s of a start-up
    n = min(32, max(1, SWAP_PROBE_BYTES // runner.kv_bytes_per_block), runner.num_blocks,
            runner.num_swap_blocks)
    if n:
        pairs = [(i, i) for i in range(n)]
        both = SchedulerOutput([], 0, swap_out=pairs, swap_in=pairs)
        runner.apply_block_ops(both)  # warm-up: first touches of both sides' pages
        for _ in range(3):  # the best of three: a busy moment only ever slows one
            t = time.perf_counter()
            runner.apply_block_ops(both)
            swap_bw = max(swap_bw, 2 * n * runner.kv_bytes_per_block /
                          max(time.perf_counter() - t, 1e-9))
    tokens = min(prefill_tokens, runner.num_blocks * runner.block_size, runner.max_model_len)
    blocks = list(range(runner.blocks_needed(tokens)))
    seq = ScheduledSequence("warmup", [0] * tokens, 0, blocks, False, SamplingParams())
    ids, pos, meta, _ = runner.prepare_inputs(SchedulerOutput([seq], tokens))
    last = torch.tensor([tokens - 1], device=runner.device)
    rate = 0.0
    for _ in range(2):  # the first pass warms up allocators and kernels
        t = time.perf_counter()
        runner.model.forward(ids, pos, meta, runner.kv_caches, last)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        rate = tokens / max(time.perf_counter() - t, 1e-9)
    if buckets:
        warm_buckets(runner)
    # Warm the decode path too (its first step pays lazy set-up: the fused forward's
    # scratch, the sampler), so that the first request is served like the tenth.
    decode = ScheduledSequence("warmup", [0], tokens - 1, blocks, True,
                               SamplingParams(temperature=0.0))
    for _ in range(2):
        runner._execute(SchedulerOutput([decode], 1))
    first_thread_probe(runner, SchedulerOutput([seq], tokens))
    return swap_bw, rate


def warm_buckets(runner: ModelRunner) -> None:
    """One forward at each row bucket serving will use that the rate measurement's
    128-token prefill does not (``plan.BUCKETS``): 16 rows, and a prefill chunk of
    max_num_batched_tokens tokens twice, the second over the first's K/V (a long prompt's
    later chunks: attention over a cached context). A path's first call at a bucket pays
    lazy set-up (oneDNN's bf16 primitives and their weight reorders, first touches of
    scratch), which without this landed on the first long prompt.

    Where no bucket takes bf16, our C++ and fp32 paths have little set-up to pay, and a
    warm-up that would cost more than its budget is left out: the 16-row forward beyond
    WARMUP_MACS (3B and up; after the 2-token prefill the 8B Q4_K_M file's first 16-row
    forward took 2.24 s against 2.04 s for the next three, the 3B's 0.99 s against
    0.80-1.00, on a 2-core Zen 3: the warm-up cost 2 s of every start to save 0.2 s of one
    request), the two chunks beyond WARM_CHUNK_MACS (1B and up: at the 8B shape they took
    about a minute on 2 cores)."""
    cap = min(runner.num_blocks * runner.block_size, runner.max_model_len)
    chunk = min(runner.max_batched_tokens, cap // 2)
    rows = min(16, cap)
    bf16 = runner.linear_plan is not None and any(
        "bf16" in names for names in runner.linear_plan.choices.values())
    macs = decoder_macs_per_token(runner.loaded.hf_config)
    if not bf16 and rows * macs > WARMUP_MACS:
        rows = 0
    if not bf16 and 2 * chunk * macs > WARM_CHUNK_MACS:
        chunk = 0  # C++ paths only, and a big model: minutes of start-up at the 8B shape
    for tokens, chunks in ((rows, 1), (chunk, 2)):
        if tokens < 1:
            continue
        blocks = list(range(runner.blocks_needed(tokens * chunks)))
        for c in range(chunks):
            seq = ScheduledSequence("warmup", [0] * tokens, c * tokens, blocks, False,
                                    SamplingParams())
            ids, pos, meta, _ = runner.prepare_inputs(SchedulerOutput([seq], tokens))
            last = torch.tensor([tokens - 1], device=runner.device)
            runner.model.forward(ids, pos, meta, runner.kv_caches, last)


def first_thread_probe(runner: ModelRunner, warmup: SchedulerOutput) -> None:
    """Run the thread tuner's first probe to its verdict on repeats of the `warmup` step
    (the tuner starts a probe at the first step it is asked about), so that the first
    requests run at the count it keeps and do not pay for the probe's steps at one thread
    fewer: a 512-token step at one thread of two took 1.1 s against 0.55 on Zen 4, and the
    first probe had landed on the first requests' steps. Costs five warm-up steps when the
    candidate collapses (it aborts at its first step), at most the probe's whole plan
    otherwise. Nothing to do without a tuner."""
    tuner = runner.thread_tuner
    if tuner is None:
        return
    s = tuner.s
    for _ in range(2 * s.blocks * s.probe_steps):  # the whole plan at most
        runner.execute(warmup)
        if not tuner.probing:
            break
    if tuner.history:
        _, before, after, ratio = tuner.history[-1]
        log.info("threads: the start-up probe %s %d (candidate / current step time: %s)",
                 "kept" if after == before else "chose", after,
                 "n/a" if ratio is None else f"{ratio:.2f}")


def gate_inputs(runner: ModelRunner) -> tuple[Score, int]:
    """(score, its text's tokens) for the quality gate of 16-bit compute
    (``quality_gate.run_gate``): score(rows) -> the Predictions of the gate's text
    (``gate_token_ids``, capped by the KV cache and the context), fed in chunks of `rows`
    tokens through the empty cache's first blocks (zeroed after)."""
    ids = gate_token_ids(runner.tokenizer, min(runner.num_blocks * runner.block_size,
                                               runner.max_model_len))
    blocks = list(range(runner.blocks_needed(len(ids))))

    @torch.inference_mode()
    def score(rows: int) -> Predictions:
        parts = []
        for start in range(0, len(ids) - 1, rows):
            chunk = ids[start:start + rows]
            seq = ScheduledSequence("gate", chunk, start, blocks, False, SamplingParams())
            input_ids, positions, meta, _ = runner.prepare_inputs(
                SchedulerOutput([seq], len(chunk)))
            every = torch.arange(len(chunk), device=runner.device)
            logits = runner.model.forward(input_ids, positions, meta, runner.kv_caches, every)
            parts.append(predictions(logits, ids[start + 1:start + rows + 1]))
        for kv in runner.kv_caches:
            kv[:, blocks] = 0
        return Predictions(torch.cat([p.top1 for p in parts]),
                           torch.cat([p.nll for p in parts]))

    return score, len(ids)


@torch.inference_mode()
def calibrate(runner: ModelRunner) -> list:
    """Per-layer AmaxObservers after a dense forward over `calibration_token_ids`, in
    chunks of 512, using the empty cache's first blocks as scratch (zeroed after)."""
    ids = calibration_token_ids(runner.tokenizer)
    ids = ids[:min(len(ids), runner.num_blocks * runner.block_size, runner.max_model_len)]
    blocks = list(range(runner.blocks_needed(len(ids))))
    last = torch.zeros(1, dtype=torch.int64, device=runner.device)
    with runner.model.observe_linear_inputs() as observed:
        for start in range(0, len(ids), 512):
            chunk = ids[start:start + 512]
            seq = ScheduledSequence("calibration", chunk, start, blocks, False,
                                    SamplingParams())
            input_ids, positions, meta, _ = runner.prepare_inputs(
                SchedulerOutput([seq], len(chunk)))
            runner.model.forward(input_ids, positions, meta, runner.kv_caches, last)
    for kv in runner.kv_caches:
        kv[:, blocks] = 0
    log.info("SmoothQuant calibration on %d tokens", len(ids))
    return observed
