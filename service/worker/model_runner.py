"""Model runner: turns a SchedulerOutput into one forward and one batched sample.

Owns the model weights and the paged KV cache (one tensor per layer,
`[2, num_blocks, block_size, Hkv, D]`, sized at start-up). Runs in the step
loop's worker thread; nothing here touches asyncio.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from itertools import chain

import torch

from protocol import SamplingParams
from kernels import AttentionLayout, AttentionMetadata, resolve_backend, select_ops
from service.core.config import EngineConfig
from service.worker.cpu_threads import default_num_threads
from service.worker.thread_tuner import ThreadTuner
from service.worker.loader import LoadedModel, default_model_path, load_model, model_name
from service.worker.sliding_window import context_limit
from service.worker.heap_trim import trim_heap
from service.worker.memory_fit import (BF16_COPY_SHARE, GiB, MemoryNeed, ModelDoesNotFit,
                                       available_memory, check_fits, weights_need)
from service.worker.decode_kernel import (check_decode_kernel_builds, choose_decode_kernel,
                                          choose_prefill_bf16_dot)
from service.worker.fused_forward import build_fused_forward
from service.worker.weight_pages import packed_weights_on_huge_pages
from service.worker.gguf_parse import shared_gguf_parse
from service.worker.huge_pages import zeros_on_huge_pages
from service.worker.model import LlamaModel
from service.worker.quantization import calibration_token_ids
from service.worker.gguf_weights import linear_weights_of
from service.worker.quantization.apply import apply_linear_plan
from service.worker.quantization.gate_text import gate_token_ids
from service.worker.quantization.quality_gate import Predictions, Score, predictions
from service.worker.quantization.paths import bf16_hardware
from service.worker.quantization.census import layer_formats
from service.worker.quantization.plan import LinearPlan
from service.worker.logits_processors import (RowHistory, apply_logits_processors,
                                              needs_prompt, plan_logits_processing)
from service.worker.logprob_rows import prompt_rows, sampled_logprobs, score_prompt_rows
from service.worker.sampler import (GREEDY_EPS, build_sampling_tensors, check_sampling_params,
                                   greedy_tokens, make_generator, sample)
from service.worker.section_timer import SectionTimer
from service.worker.token_mask import apply_token_masks_, fill_token_masks
from service.core.scheduler_output import RunnerOutput, ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


WARMUP_MACS = 16_000_000_000
"""The start-up prefill steps' budget in multiply-adds of the decoder layers' linear layers:
about 128 tokens of SmolLM2-135M (106 M a token). 128 tokens at the 8B shape took minutes on
2 cores: the thread probe's 16 steps at about 7 GMAC a token, half of them on one thread."""


WARM_CHUNK_MACS = 8 * WARMUP_MACS
"""The most the start-up's two prefill-chunk warm-ups may cost (multiply-adds) where only
our C++ kernels serve: SmolLM2-135M's 2 x 512 tokens fit (109 G), Llama-3.2-1B's do not."""


def warmup_tokens(hf_config: object) -> int:
    """Tokens of the start-up prefill steps (``ModelRunner.measure_rates``): as many as
    WARMUP_MACS buys, at most 128, at least 1, a multiple of 16 from 16 on. E.g. SmolLM2-135M
    128, Llama-3.2-1B 16, Llama-3.2-3B 5, Llama-3.1-8B 2. (Their prefill rate then reads low
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


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu. Raises ValueError for cuda without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return dev


SWAP_PROBE_BYTES = 32 << 20
"""The swap-rate measurement at start-up copies at most this many bytes of KV blocks each way."""


class ModelRunner:
    """Loads the model, allocates the KV cache and executes steps.

    Args:
        config: engine settings (model, dtype, device, block size, KV cache size).
        loaded: an already loaded checkpoint (tests share one); None loads config.model.model.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        self.dtype = DTYPES[mc.dtype]
        # The K/V cache's element type: the model's, or 16 bits under any (--kv-cache-dtype)
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else DTYPES[cc.kv_cache_dtype]
        threads = mc.num_threads or default_num_threads()
        # Whether a GGUF file's decoder-layer blocks may get a bf16 copy for 16-bit compute
        # (its memory checked with the rest, in _check_fits)
        self._bf16_blocks_fit = False
        self._fit_checked = False
        self._bf16_compute = mc.cpu_bf16_compute in ("auto", "on")
        self._bf16_any_share = mc.cpu_bf16_compute == "on"  # the blocks' copy: no share cap
        self._max_batched_tokens = config.scheduler.max_num_batched_tokens
        if self.device.type == "cpu":
            # One intra-op thread per CPU this process may use (affinity and cgroup
            # quota). Call from the thread that runs the steps: OpenMP's thread count is
            # per calling thread, and the C++ decode kernel's parallel region inherits it.
            torch.set_num_threads(threads)
        # Steps ask it how many threads to run with (fewer while a busy neighbour makes
        # that faster) and tell it how long they took.
        self.thread_tuner: ThreadTuner | None = (
            ThreadTuner(threads) if self.device.type == "cpu" and mc.adaptive_threads
            and threads > 1 else None)
        # Batch invariance runs every attention row through the C++ decode kernel.
        decode_setting = "cpp" if mc.batch_invariant else mc.cpu_decode_kernel
        self.batch_invariant = mc.batch_invariant
        if decode_setting == "cpp" and self.device.type == "cpu":
            check_decode_kernel_builds()  # before the model load: fail in a second, not in 20
        # auto serves the checkpoint's own weights on the CPU in fp32; elsewhere it is dense
        self.quantization = mc.quantization if mc.quantization != "auto" or (
            self.device.type == "cpu" and self.dtype == torch.float32) else None
        with shared_gguf_parse():  # a GGUF file parsed once for transformers and our blocks
            # auto on the CPU: a GGUF file's linear layers are read as its blocks, never as
            # dense fp32 (memory about the file's size); other modes need dense weights
            self.loaded = loaded or load_model(
                mc.model, self.dtype, blocks=self.quantization in ("auto", "auto-a8")
                and self.device.type == "cpu",
                before_weights=lambda *a: self._check_fits(config, *a))
            if not self._fit_checked and self.loaded.blocks_only:
                # a caller's LoadedModel (never refused here, as before): only whether the
                # bf16 copy of its blocks fits
                try:
                    self._check_fits(config, self.loaded.hf_config, self.loaded.gguf_linear,
                                     self.loaded.embedding.nbytes)  # type: ignore[union-attr]
                except ModelDoesNotFit as e:
                    log.warning("%s", e)
            # a caller's LoadedModel may serve more runners: keep its blocks on it
            gguf = linear_weights_of(self.loaded, keep=loaded is not None) \
                if self.quantization in ("auto", "auto-a8") else None
        cfg = self.loaded.hf_config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        backend = resolve_backend(mc.attention_backend, self.device)  # "torch" or "triton"
        self.decode_kernel = choose_decode_kernel(decode_setting, backend, self.device,
                                                  self.dtype, heads, kv_heads, head_dim,
                                                  self.kv_dtype)
        # prefill chunks' C++ attention in bf16 products where the CPU has them (not the oracle)
        self.prefill_bf16_dot = choose_prefill_bf16_dot(self.decode_kernel, self.quantization,
                                                         self.batch_invariant)
        self.ops = select_ops(backend, self.device, AttentionLayout(
            heads, kv_heads, head_dim, self.dtype, cc.block_size, self.decode_kernel,
            all_rows=self.batch_invariant, kv_dtype=self.kv_dtype,
            prefill_bf16_dot=self.prefill_bf16_dot))
        self.model = LlamaModel(self.loaded, self.ops, self.device, self.dtype)
        self._timer: SectionTimer | None = None
        self._timer_scope = ExitStack()  # the model's instrumentation while a timer is set
        self.tokenizer = self.loaded.tokenizer
        self.vocab = self.model.vocab_size
        self._generators: dict[str, torch.Generator] = {}  # seeded requests, by request id
        # prompts as int64 tensors of requests with a repetition penalty, by request id
        self._prompt_ids: dict[str, torch.Tensor] = {}
        self.block_size = cc.block_size
        model_len, capped = context_limit(self.loaded.hf_config, self.model.max_position)
        if capped is not None and (mc.max_model_len or model_len + 1) > model_len:
            log.warning("%s", capped)
        self.max_model_len = min(mc.max_model_len or model_len, model_len)
        per_block = self.model.kv_bytes_per_token(self.kv_dtype) * cc.block_size
        self.num_blocks = cc.num_kv_blocks or max(2, cc.kv_cache_memory // per_block)
        shape = (2, self.num_blocks, cc.block_size, self.model.num_kv_heads, self.model.head_dim)
        # On the CPU the cache's memory asks for 2 MiB pages: a step reads its blocks
        # scattered over all of it (service/worker/huge_pages.py)
        self.kv_caches = [zeros_on_huge_pages(shape, self.kv_dtype) if self.device.type == "cpu"
                          else torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                          for _ in range(self.model.num_layers)]
        self.kv_cache_bytes = per_block * self.num_blocks
        self.kv_bytes_per_block = per_block
        # Linear kernels: chosen by measurement here (quantization, batch invariance).
        self.linear_plan: LinearPlan | None = None
        if self.quantization is not None or mc.batch_invariant:
            # Decode-sized buckets (up to 16 rows) lean to the C++ kernels that the fused
            # forward can call, where it will run.
            fusing = (self.device.type == "cpu" and self.decode_kernel == "cpp"
                      and mc.cpu_fused_decode != "off")
            self.linear_plan = apply_linear_plan(
                self.model, self.quantization or "none", mc.batch_invariant, self.calibrate,
                gguf, fused_rows=16 if fusing else 0, bf16=self._bf16_compute,
                round_blocks=self._bf16_blocks_fit,
                gate=self._gate_inputs if self.device.type == "cpu" else None,
                gate_model=None if loaded is not None else mc.model or default_model_path())
            if self.device.type == "cpu":  # before the fused forward keeps their addresses
                moved = packed_weights_on_huge_pages(self.model)
                log.debug("decode-bucket packed weights on huge pages: %.1f MB", moved / 1e6)
        del gguf  # the blocks' unpacked values: not held once packed
        # Decode steps (every step when batch-invariant) as one native call where the
        # linear plan put C++ kernels on every layer.
        self.model.fused, self.fused_decode = build_fused_forward(
            self.model, self.kv_caches, mc.cpu_fused_decode if self.device.type == "cpu"
            else "off", self.decode_kernel)
        # CPU swap space, shaped like the cache (pinned when the cache is on a GPU)
        self.num_swap_blocks = int(cc.swap_space * (1 << 30)) // per_block
        swap_shape = (2, self.num_swap_blocks) + shape[2:]
        pin = self.device.type == "cuda"
        # empty, not zeros: a swap block is always written before it is read, and untouched
        # pages stay off the resident set until a preemption first swaps into them
        self.swap_caches = [torch.empty(swap_shape, dtype=self.kv_dtype, pin_memory=pin)
                            for _ in range(self.model.num_layers)] if self.num_swap_blocks else []
        trim_heap()  # packing's freed scratch back to the system
        log.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB; swap space %d blocks",
                 self.num_blocks, cc.block_size, str(self.kv_dtype).removeprefix("torch."),
                 self.kv_cache_bytes / 2**20, self.num_swap_blocks)

    def _check_fits(self, config: EngineConfig, hf_config: object, blocks: object | None,
                    embedding_bytes: int) -> None:
        """Refuse (ModelDoesNotFit) a model whose weights, KV cache and swap space need more
        memory than is available, before any of it is allocated (CPU only: a GPU's memory is
        not this process's RAM)."""
        self._fit_checked = True
        if self.device.type != "cpu":
            return
        cc = config.cache
        heads = hf_config.num_attention_heads  # type: ignore[attr-defined]
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads  # type: ignore[attr-defined]
        per_block = (2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads  # type: ignore[attr-defined]
                     * head_dim * self.kv_dtype.itemsize * cc.block_size)
        kv = per_block * cc.num_kv_blocks if cc.num_kv_blocks else \
            per_block * max(2, cc.kv_cache_memory // per_block)
        dtype_scale = 1 if blocks is not None else self.dtype.itemsize / 4
        weights, transient = weights_need(hf_config, blocks, embedding_bytes)
        need = MemoryNeed(int(weights * dtype_scale), kv,
                          int(cc.swap_space * (1 << 30)) // per_block * per_block,
                          int(transient * dtype_scale))
        name = model_name(config.model.model or default_model_path())
        check_fits(need, name)
        self._bf16_blocks_fit = self._bf16_copy_fits(need, blocks, name)

    def _bf16_copy_fits(self, need: MemoryNeed, blocks: object | None, name: str) -> bool:
        """Whether 16-bit compute may serve a GGUF file's decoder-layer blocks: allowed
        (--cpu-bf16-compute auto or on), bf16 in hardware, and their bf16 copy (16 bits a
        weight: 1.9 GiB at Llama-3.2-1B's shape, 13 GiB at 8B's) fits beside `need` (the
        weights, KV cache and swap space) and, under auto, takes at most
        ``BF16_COPY_SHARE`` of the available memory; a log line says why where it does not."""
        if blocks is None or not self._bf16_compute or bf16_hardware() is None:
            return False
        layers = blocks.layers.items()  # type: ignore[attr-defined]
        copy = 2 * sum(b.out_features * b.in_features for (i, _), b in layers if i is not None)
        try:
            check_fits(MemoryNeed(need.weights + copy, need.kv_cache, need.swap_space,
                                  need.transient), name)
        except ModelDoesNotFit as e:
            log.warning("16-bit compute stays off the GGUF blocks: their bf16 copy (%.2f GiB) "
                        "does not fit beside them (%s)", copy / GiB, e)
            return False
        available, source = available_memory()
        if not self._bf16_any_share and available is not None \
                and copy > BF16_COPY_SHARE * available:
            log.info("16-bit compute stays off the GGUF blocks: their bf16 copy (%.2f GiB) "
                     "would take more than %d%% of the %.2f GiB available (%s); "
                     "--cpu-bf16-compute on takes it wherever it fits", copy / GiB,
                     round(100 * BF16_COPY_SHARE), available / GiB, source)
            return False
        return True

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                            AttentionMetadata, torch.Tensor]:
        """(input_ids [T], positions [T], metadata, logits_indices [S]) for one step.

        Built from flat Python lists with vectorised index math: no per-token loop, and
        the only per-sequence work is reading each sequence's fields once. A step of
        decodes only (one token per sequence, every decode step) is built in Python lists
        instead (`_prepare_decodes`: the same tensors in 0.12 against 0.39 ms for one
        sequence, 0.2-0.3 against 0.5 for 16, one AVX2 thread beside other work: each
        torch op costs more than the few list operations it saves).
        """
        seqs = out.sequences
        if all(len(s.token_ids) == 1 for s in seqs):
            return self._prepare_decodes(seqs)
        return self._prepare_general(seqs)

    def _prepare_decodes(self, seqs: list[ScheduledSequence]) -> tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """prepare_inputs for B sequences of one token each (T == B)."""
        B = len(seqs)
        bs = self.block_size
        positions = [s.num_computed_tokens for s in seqs]
        tables = [s.block_table for s in seqs]
        width = max(map(len, tables))
        # E.g. block_size 4, position 7 of a sequence with blocks [5, 2] -> slot 2 * 4 + 3 = 11
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        table = torch.tensor([t if len(t) == width else t + [0] * (width - len(t))
                              for t in tables], dtype=torch.int64)
        seq_lens = [p + 1 for p in positions]
        cu_q = torch.arange(B + 1, dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=table.to(dev, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=cu_q.to(dev, torch.int32),
            plan=self.ops.plan_step([1] * B, seq_lens, cu_q, table, dev),
        )
        ids = torch.tensor([s.token_ids[0] for s in seqs], dtype=torch.int64, device=dev)
        logits_indices = torch.tensor([i for i, s in enumerate(seqs) if s.sample],
                                      dtype=torch.int64, device=dev)
        return ids, torch.tensor(positions, dtype=torch.int64, device=dev), meta, logits_indices

    def _prepare_general(self, seqs: list[ScheduledSequence]) -> tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """prepare_inputs for any step (prefill chunks, decodes, both)."""
        B = len(seqs)
        bs = self.block_size
        q_lens = [len(s.token_ids) for s in seqs]
        computed_list = [s.num_computed_tokens for s in seqs]
        table_lens = [len(s.block_table) for s in seqs]
        ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.int64)
        T = ids.shape[0]
        n = torch.tensor(q_lens, dtype=torch.int64)
        computed = torch.tensor(computed_list, dtype=torch.int64)
        # E.g. n = [3, 1], computed = [0, 7] -> cu_q = [0, 3, 4], seq_lens = [3, 8]
        cu_q = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(n, 0, out=cu_q[1:])
        seq_lens = computed + n
        # Block tables, row b = sequence b's blocks then zeros, filled in one masked write.
        # E.g. tables [[5, 2], [7]] -> [[5, 2], [7, 0]]
        max_blocks = max(table_lens)
        table = torch.zeros(B, max_blocks, dtype=torch.int64)
        filled = torch.arange(max_blocks)[None, :] < torch.tensor(table_lens)[:, None]
        table[filled] = torch.tensor(list(chain.from_iterable(s.block_table for s in seqs)),
                                     dtype=torch.int64)
        if T == B:  # decodes only: token i is sequence i's token at position computed[i]
            seq_idx = torch.arange(B)
            positions = computed
        else:
            # E.g. seq_idx = [0, 0, 0, 1]; positions = [0, 1, 2, 7]
            seq_idx = torch.repeat_interleave(torch.arange(B), n)
            positions = torch.arange(T) + (computed - cu_q[:-1])[seq_idx]
        # E.g. block_size 4, position 7 of a sequence with blocks [5, 2] -> slot 2 * 4 + 3 = 11
        slots = table[seq_idx, positions // bs] * bs + positions % bs
        # E.g. sample = [True, True] -> logits rows [2, 3] (each sampling sequence's last token)
        sample_mask = torch.tensor([s.sample for s in seqs], dtype=torch.bool)
        logits_indices = cu_q[1:][sample_mask] - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=table.to(dev, torch.int32),
            seq_lens=seq_lens.to(dev, torch.int32),
            cu_seqlens_q=cu_q.to(dev, torch.int32),
            plan=self.ops.plan_step(q_lens, [c + q for c, q in zip(computed_list, q_lens)],
                                    cu_q, table, dev),
        )
        return ids.to(dev), positions.to(dev), meta, logits_indices.to(dev)

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies, in that order, on every layer."""
        for pairs, src_caches, dst_caches in (
                (out.swap_out, self.kv_caches, self.swap_caches),
                (out.swap_in, self.swap_caches, self.kv_caches),
                (out.copy_blocks, self.kv_caches, self.kv_caches)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs], device=src_caches[0].device)
            dst = torch.tensor([p[1] for p in pairs], device=dst_caches[0].device)
            for s_cache, d_cache in zip(src_caches, dst_caches):
                d_cache[:, dst] = s_cache[:, src].to(d_cache.device, non_blocking=True)
        if self.device.type == "cuda" and (out.swap_out or out.swap_in):
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def measure_rates(self, prefill_tokens: int | None = None) -> tuple[float, float]:
        """(swap bytes/s, prefill tokens/s) measured on this machine (a few hundred ms),
        then two decode steps to warm the decode path up, then the thread tuner's first
        probe on prefill steps of `prefill_tokens` (`_first_thread_probe`; default
        ``warmup_tokens``: 128 at SmolLM2-135M's size, fewer for bigger models).

        Uses blocks of the empty cache as scratch: call before any request runs.
        """
        if prefill_tokens is None:
            prefill_tokens = warmup_tokens(self.loaded.hf_config)
        swap_bw = 0.0
        # at most 32 blocks and SWAP_PROBE_BYTES of them: 32 blocks are 23 MB at 135M's
        # shape but 128 MB at 8B's, whose first touches and copies took 8.8 s of a start-up
        n = min(32, max(1, SWAP_PROBE_BYTES // self.kv_bytes_per_block), self.num_blocks,
                self.num_swap_blocks)
        if n:
            pairs = [(i, i) for i in range(n)]
            both = SchedulerOutput([], 0, swap_out=pairs, swap_in=pairs)
            self.apply_block_ops(both)  # warm-up: first touches of both sides' pages
            for _ in range(3):  # the best of three: a busy moment only ever slows one
                t = time.perf_counter()
                self.apply_block_ops(both)
                swap_bw = max(swap_bw, 2 * n * self.kv_bytes_per_block /
                              max(time.perf_counter() - t, 1e-9))
        tokens = min(prefill_tokens, self.num_blocks * self.block_size, self.max_model_len)
        blocks = list(range(self.blocks_needed(tokens)))
        seq = ScheduledSequence("warmup", [0] * tokens, 0, blocks, False, SamplingParams())
        ids, pos, meta, _ = self.prepare_inputs(SchedulerOutput([seq], tokens))
        last = torch.tensor([tokens - 1], device=self.device)
        rate = 0.0
        for _ in range(2):  # the first pass warms up allocators and kernels
            t = time.perf_counter()
            self.model.forward(ids, pos, meta, self.kv_caches, last)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            rate = tokens / max(time.perf_counter() - t, 1e-9)
        self._warm_buckets()
        # Warm the decode path too (its first step pays lazy set-up: the fused forward's
        # scratch, the sampler), so that the first request is served like the tenth.
        decode = ScheduledSequence("warmup", [0], tokens - 1, blocks, True,
                                   SamplingParams(temperature=0.0))
        for _ in range(2):
            self._execute(SchedulerOutput([decode], 1))
        self._first_thread_probe(SchedulerOutput([seq], tokens))
        return swap_bw, rate

    def _warm_buckets(self) -> None:
        """One forward at each row bucket serving will use that the rate measurement's
        128-token prefill does not (``plan.BUCKETS``): 16 rows, and a prefill chunk of
        max_num_batched_tokens tokens twice, the second over the first's K/V (a long
        prompt's later chunks: attention over a cached context). A path's first call at a
        bucket pays lazy set-up (oneDNN's bf16 primitives and their weight reorders, first
        touches of scratch), which without this landed on the first long prompt. Uses the
        empty cache's first blocks as scratch: call before any request runs. The two chunks
        are left out where no bucket takes bf16 and they would cost more than
        WARM_CHUNK_MACS (1B and up: at the 8B shape they took about a minute on 2 cores)."""
        cap = min(self.num_blocks * self.block_size, self.max_model_len)
        chunk = min(self._max_batched_tokens, cap // 2)
        bf16 = self.linear_plan is not None and any(
            "bf16" in names for names in self.linear_plan.choices.values())
        if not bf16 and 2 * chunk * decoder_macs_per_token(self.loaded.hf_config) > \
                WARM_CHUNK_MACS:
            chunk = 0  # C++ paths only, and a big model: minutes of start-up at the 8B shape
        for tokens, chunks in ((min(16, cap), 1), (chunk, 2)):
            if tokens < 1:
                continue
            blocks = list(range(self.blocks_needed(tokens * chunks)))
            for c in range(chunks):
                seq = ScheduledSequence("warmup", [0] * tokens, c * tokens, blocks, False,
                                        SamplingParams())
                ids, pos, meta, _ = self.prepare_inputs(SchedulerOutput([seq], tokens))
                last = torch.tensor([tokens - 1], device=self.device)
                self.model.forward(ids, pos, meta, self.kv_caches, last)

    def _first_thread_probe(self, warmup: SchedulerOutput) -> None:
        """Run the thread tuner's first probe to its verdict on repeats of the `warmup`
        step (the tuner starts a probe at the first step it is asked about), so that the
        first requests run at the count it keeps and do not pay for the probe's steps at
        one thread fewer: a 512-token step at one thread of two took 1.1 s against 0.55
        on Zen 4, and the first probe had landed on the first requests' steps. Costs
        five warm-up steps when the candidate collapses (it aborts at its first step),
        at most the probe's whole plan otherwise. Nothing to do without a tuner."""
        tuner = self.thread_tuner
        if tuner is None:
            return
        s = tuner.s
        for _ in range(2 * s.blocks * s.probe_steps):  # the whole plan at most
            self.execute(warmup)
            if not tuner.probing:
                break
        if tuner.history:
            _, before, after, ratio = tuner.history[-1]
            log.info("threads: the start-up probe %s %d (candidate / current step time: %s)",
                     "kept" if after == before else "chose", after,
                     "n/a" if ratio is None else f"{ratio:.2f}")

    def _gate_inputs(self) -> tuple[Score, int]:
        """(score, its text's tokens) for the quality gate of 16-bit compute
        (``quality_gate.run_gate``): score(rows) -> the Predictions of the gate's text
        (``gate_token_ids``, capped by the KV cache and the context), fed in chunks of `rows`
        tokens through the empty cache's first blocks (zeroed after)."""
        ids = gate_token_ids(self.tokenizer, min(self.num_blocks * self.block_size,
                                                 self.max_model_len))
        blocks = list(range(self.blocks_needed(len(ids))))

        @torch.inference_mode()
        def score(rows: int) -> Predictions:
            parts = []
            for start in range(0, len(ids) - 1, rows):
                chunk = ids[start:start + rows]
                seq = ScheduledSequence("gate", chunk, start, blocks, False, SamplingParams())
                input_ids, positions, meta, _ = self.prepare_inputs(
                    SchedulerOutput([seq], len(chunk)))
                every = torch.arange(len(chunk), device=self.device)
                logits = self.model.forward(input_ids, positions, meta, self.kv_caches, every)
                parts.append(predictions(logits, ids[start + 1:start + rows + 1]))
            for kv in self.kv_caches:
                kv[:, blocks] = 0
            return Predictions(torch.cat([p.top1 for p in parts]),
                               torch.cat([p.nll for p in parts]))

        return score, len(ids)

    @torch.inference_mode()
    def calibrate(self) -> list:
        """Per-layer AmaxObservers after a dense forward over `calibration_token_ids`, in
        chunks of 512, using the empty cache's first blocks as scratch (zeroed after)."""
        ids = calibration_token_ids(self.tokenizer)
        ids = ids[:min(len(ids), self.num_blocks * self.block_size, self.max_model_len)]
        blocks = list(range(self.blocks_needed(len(ids))))
        last = torch.zeros(1, dtype=torch.int64, device=self.device)
        with self.model.observe_linear_inputs() as observed:
            for start in range(0, len(ids), 512):
                chunk = ids[start:start + 512]
                seq = ScheduledSequence("calibration", chunk, start, blocks, False,
                                        SamplingParams())
                input_ids, positions, meta, _ = self.prepare_inputs(
                    SchedulerOutput([seq], len(chunk)))
                self.model.forward(input_ids, positions, meta, self.kv_caches, last)
        for kv in self.kv_caches:
            kv[:, blocks] = 0
        log.info("SmoothQuant calibration on %d tokens", len(ids))
        return observed

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def release(self) -> None:
        """Drop the KV cache, the swap space and the model's own weights now (the engine
        closed), instead of whenever the garbage collector reaches the engine's reference
        cycles: about 0.9 GB with the test engines' small caches, 2 GiB+ by default.
        The checkpoint (`loaded`) and the tokenizer stay. Idempotent.

        Raises nothing; `execute()` raises RuntimeError afterwards.
        """
        self.kv_caches = []
        self.swap_caches = []
        self.model = None  # type: ignore[assignment]

    # ---- what the engine's front reads ---------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loaded.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def describe(self) -> dict[str, str]:
        """What the engine_ready log line says about this runner."""
        return {"device": str(self.device), "kernels": self.ops.name,
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "quantization": self.quantization or "none",
                "batch_invariant": str(self.batch_invariant).lower(),
                "decode_kernel": self.decode_kernel,
                "prefill_attention": ("cpp-bf16" if self.prefill_bf16_dot
                                      else self.decode_kernel),
                "fused_decode": self.fused_decode,
                # the measured choice, one path per row bucket (1, 16, 64, 512) per class
                "linear_kernels": (self.linear_plan.summary() if self.linear_plan is not None
                                   else "fp32"),
                # linear layers per weight format, counted on the layers themselves
                "linear_layers": " ".join(f"{k}={v}" for k, v in
                                          self.linear_layer_formats().items())}

    def linear_layer_formats(self) -> dict[str, int]:
        """{weight format: linear layers it serves} ("fp32", "int8", "int4", "fp32+int8"
        for a layer whose row buckets differ), LM head included; {} after release()."""
        if self.model is None:
            return {}
        return layer_formats(self.model.layers, self.model.lm_head)

    # ---- one step ---------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step's forward and sample the sequences with `sample` (the block ops are
        `apply_block_ops`, called first by EngineCore); forget `out.finished_request_ids`.

        Returns their tokens; a row with non-finite logits or out-of-range sampling
        params is in `failed` (the other rows are unaffected). With a thread tuner (CPU,
        adaptive_threads) the step runs with the thread count it asks for, and its wall
        time is reported back. Raises RuntimeError after `release()`."""
        tuner = self.thread_tuner
        if tuner is None or not out.sequences or self.model is None:
            return self._execute(out)
        n = tuner.threads_for_next_step(out.num_batched_tokens)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)  # this thread's OpenMP team, the C++ kernel's too
        t0 = time.perf_counter()
        result = self._execute(out)
        decision = tuner.observe(time.perf_counter() - t0, out.num_batched_tokens)
        if decision is not None and decision[1] != decision[2]:
            log.info("threads: %d -> %d (steps took %.2fx the time with %d)",
                     decision[1], decision[2], decision[3], decision[2])
        return result

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_request_ids:
            self._generators.pop(rid, None)
            self._prompt_ids.pop(rid, None)
        if self.model is None:
            raise RuntimeError("the model runner was released (its engine is closed)")
        if not out.sequences:
            return RunnerOutput({})
        tm = self._timer
        if tm is not None:
            tm.start()
        return self._forward_and_sample(out, tm)

    @property
    def timer(self) -> SectionTimer | None:
        """Benchmarks set a SectionTimer to split each execute() into build_batch, linear,
        attention, other and sample; while it is set the model's linears and attention
        are wrapped to lap it (`SectionTimer.instrument`), once, not per step. None (the
        default) restores the model and costs nothing."""
        return self._timer

    @timer.setter
    def timer(self, timer: SectionTimer | None) -> None:
        self._timer_scope.close()
        self._timer = timer
        if timer is not None:
            self._timer_scope.enter_context(timer.instrument(self.model))

    def _forward_and_sample(self, out: SchedulerOutput, tm: SectionTimer | None) -> RunnerOutput:
        input_ids, positions, meta, logits_indices = self.prepare_inputs(out)
        scored = prompt_rows(out.sequences)
        if scored is not None:  # the LM head also runs on the prompt rows to score
            logits_indices = torch.cat([logits_indices, scored.rows.to(logits_indices.device)])
        if tm is not None:
            tm.lap("build_batch")
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches, logits_indices)
        prompt_lps = {}
        if scored is not None:
            num_sampling = logits.shape[0] - scored.rows.shape[0]
            prompt_lps = score_prompt_rows(logits[num_sampling:], scored)
            logits = logits[:num_sampling]
        sampling = [s for s in out.sequences if s.sample]
        if not sampling:
            return RunnerOutput({}, prompt_logprobs=prompt_lps)
        failed: dict[str, str] = {}
        try:
            check_sampling_params([s.params for s in sampling])
        except ValueError:  # admission checks params: find the row, keep the others
            keep = []
            for i, s in enumerate(sampling):
                try:
                    check_sampling_params([s.params])
                    keep.append(i)
                except ValueError as e:
                    failed[s.request_id] = str(e)
            sampling = [sampling[i] for i in keep]
            logits = logits[keep]
            if not sampling:
                return RunnerOutput({}, failed, prompt_logprobs=prompt_lps)
        raw = logits  # logprobs are the model's own distribution, before any mask
        if any(s.constraint is not None for s in sampling):
            sampling, logits, raw = self._mask_constrained(sampling, logits, failed)
            if not sampling:
                return RunnerOutput({}, failed, prompt_logprobs=prompt_lps)
        masked_copy = raw is not logits  # the mask's copy holds the rows as the model gave them
        logits, processed_raw = self._logits_processors(logits, sampling)
        if not masked_copy:
            raw = processed_raw
        greedy = all(s.params.temperature is not None and s.params.temperature < GREEDY_EPS
                     for s in sampling)
        if greedy:  # no sampling tensors to build: one argmax a row
            token_tensor = greedy_tokens(logits)
        else:
            tensors = build_sampling_tensors([s.params for s in sampling], logits.device)
            token_tensor = sample(logits, *tensors, [self._generator(s) for s in sampling])
        tokens = token_tensor.tolist()
        lps = sampled_logprobs(raw, token_tensor, sampling)
        if tm is not None:
            tm.lap("sample")
        sampled = {}
        for s, t in zip(sampling, tokens):
            if t < 0:
                failed[s.request_id] = "the model's logits for this sequence are not finite"
            else:
                sampled[s.request_id] = t
        return RunnerOutput(sampled, failed, lps, prompt_lps)

    def _logits_processors(self, logits: torch.Tensor,
                           sampling: list[ScheduledSequence]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """THE step where per-row logits processors change the sampling logits [S, V]
        (float32, in place), before greedy argmax or `sample`: min_tokens, logit_bias and
        the penalties (`logits_processors`); a per-row token mask (structured output)
        belongs here too. Rows that ask for none are not touched, and nothing runs in a
        step where no row asks. Returns (the logits to sample from, those to score
        logprobs on: the raw ones, a copy made before processing only when a processed row
        asks for logprobs).
        """
        histories = [RowHistory(i, s.token_history[1], self._prompt_tensor(s), s.params)
                     for i, s in enumerate(sampling) if s.token_history is not None]
        if not histories:
            return logits, logits
        plan = plan_logits_processing(histories, sorted(self.eos_token_ids), self.vocab)
        if plan is None:
            return logits, logits
        raw = logits
        if logits.dtype != torch.float32:
            logits = logits.float()  # a new tensor: raw stays as it was
        elif any(sampling[i].params.logprobs is not None for i in plan.rows):
            raw = logits.clone()
        return apply_logits_processors(logits, plan), raw

    def _prompt_tensor(self, seq: ScheduledSequence) -> torch.Tensor | None:
        """A repetition-penalised request's prompt as int64 [P] (made once, kept until it
        finishes), else None."""
        if not needs_prompt(seq.params):
            return None
        ids = self._prompt_ids.get(seq.request_id)
        if ids is None:
            ids = self._prompt_ids[seq.request_id] = torch.tensor(seq.token_history[0],
                                                                  dtype=torch.int64)
        return ids
    def _mask_constrained(self, sampling: list[ScheduledSequence], logits: torch.Tensor,
                          failed: dict[str, str]) -> tuple[list[ScheduledSequence],
                                                           torch.Tensor, torch.Tensor]:
        """Mask the constrained rows' logits (structured output, tool calls) in one batched
        call (`service.worker.token_mask`); a row whose grammar cannot go on fails alone.

        Returns (the rows still sampling, their logits [B', V] masked, the same rows
        unmasked for logprobs). Only the constrained rows are read or written, plus a copy
        of the logits when a constrained row asks for logprobs."""
        idx = [i for i, s in enumerate(sampling) if s.constraint is not None]
        masks, bad = fill_token_masks([sampling[i].constraint for i in idx],  # type: ignore[misc]
                                      logits.shape[1])
        if bad:
            for j, why in bad.items():
                failed[sampling[idx[j]].request_id] = f"structured output: {why}"
            keep_c = [j for j in range(len(idx)) if j not in bad]
            masks = masks[keep_c]
            dropped = {idx[j] for j in bad}
            keep = [i for i in range(len(sampling)) if i not in dropped]
            position = {old: new for new, old in enumerate(keep)}
            idx = [position[idx[j]] for j in keep_c]
            sampling = [sampling[i] for i in keep]
            logits = logits[keep]
        raw = logits
        if any(sampling[i].params.logprobs is not None for i in idx):
            raw = logits.clone()
        rows = None if len(idx) == len(sampling) else torch.tensor(idx, device=logits.device)
        apply_token_masks_(logits, rows, masks)
        return sampling, logits, raw

    def _generator(self, seq: ScheduledSequence) -> torch.Generator | None:
        """The request's own generator when it has a seed (made on its first sample)."""
        seed = seq.params.seed
        if seed is None:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = make_generator(seed)
        return gen
