"""Model runner: turns a SchedulerOutput into one forward and one batched sample.

Owns the model weights and the paged KV cache (one tensor per layer,
`[2, num_blocks, block_size, Hkv, D]`, sized at start-up) and the swap space. Runs in the
step loop's worker thread; nothing here touches asyncio. A step's inputs are built by
`step_inputs`, its logits sampled by `sampling_step`; the start-up forwards (rates,
warm-up, calibration, the quality gate's text) are `warmup`'s.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import torch

from kernels import AttentionLayout, resolve_backend, select_ops
from kernels.prebuild import start_builds
from service.core.config import EngineConfig
from service.core.scheduler_output import RunnerOutput, SchedulerOutput
from service.worker.cpu_threads import default_num_threads
from service.worker.decode_kernel import (check_decode_kernel_builds, choose_decode_kernel,
                                          choose_prefill_bf16_dot)
from service.worker.fused_forward import build_fused_forward
from service.worker.gguf_parse import shared_gguf_parse
from service.worker.gguf_weights import linear_weights_of
from service.worker.heap_trim import trim_heap
from service.worker.huge_pages import zeros_on_huge_pages
from service.worker.loader import LoadedModel, default_model_path, load_model, model_name
from service.worker.logprob_rows import prompt_rows, score_prompt_rows
from service.worker.memory_fit import (MemoryNeed, ModelDoesNotFit, bf16_copy_fits,
                                       check_fits, served_need)
from service.worker.model import LlamaModel
from service.worker.quantization.apply import apply_linear_plan
from service.worker.quantization.census import layer_formats
from service.worker.quantization.gate_cache import gate_model_for
from service.worker.quantization.paths import bf16_hardware
from service.worker.quantization.plan import LinearPlan
from service.worker.sampling_step import SamplingStep
from service.worker.section_timer import SectionTimer
from service.worker.sliding_window import context_limit
from service.worker.step_inputs import StepInputs, prepare_inputs
from service.worker.thread_tuner import ThreadTuner
from service.worker.warmup import calibrate, gate_inputs, measure_rates
from service.worker.weight_pages import packed_weights_on_huge_pages

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu. Raises ValueError for cuda without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return dev


class ModelRunner:
    """Loads the model, allocates the KV cache and executes steps.

    Args:
        config: engine settings (model, dtype, device, block size, KV cache size).
        loaded: an already loaded checkpoint (tests share one); None loads config.model.model.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        mc, cc = config.model, config.cache
        self._served_model_name = mc.served_model_name
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
        self.max_batched_tokens = config.scheduler.max_num_batched_tokens
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
        if self.device.type == "cpu":
            start_builds()  # every C++ kernel compiled at once where none is cached yet
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
        # the step's logits -> tokens; seeded requests' generators, penalised prompts
        self.sampling = SamplingStep(self.loaded.eos_token_ids, self.vocab)
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
        kv_tokens = self.num_blocks * cc.block_size
        if kv_tokens < self.max_model_len:
            if mc.max_model_len or cc.num_kv_blocks:  # set: served as asked, said once
                log.info("the KV cache holds %d tokens, fewer than the context served (%d, "
                         "max_model_len): a request needing more is refused; "
                         "--kv-cache-memory raises the first, --max-model-len lowers the "
                         "second", kv_tokens, self.max_model_len)
            else:  # both defaults: serve (and advertise) the context the cache can hold
                log.info("max_model_len %d: what the KV cache (%.1f GiB) holds, below the "
                         "model's context (%d); --kv-cache-memory raises it, --max-model-len "
                         "sets it", kv_tokens, self.kv_cache_bytes / 2**30,
                         self.max_model_len)
                self.max_model_len = kv_tokens
        # Linear kernels: chosen by measurement here (quantization, batch invariance).
        self.linear_plan: LinearPlan | None = None
        if self.quantization is not None or mc.batch_invariant:
            # Decode-sized buckets (up to 16 rows) lean to the C++ kernels that the fused
            # forward can call, where it will run.
            fusing = (self.device.type == "cpu" and self.decode_kernel == "cpp"
                      and mc.cpu_fused_decode != "off")
            self.linear_plan = apply_linear_plan(
                self.model, self.quantization or "none", mc.batch_invariant,
                lambda: calibrate(self),
                gguf, fused_rows=16 if fusing else 0, bf16=self._bf16_compute,
                round_blocks=self._bf16_blocks_fit,
                gate=(lambda: gate_inputs(self)) if self.device.type == "cpu" else None,
                gate_model=gate_model_for(mc.model, default_model_path(),
                                          self.loaded.gguf_path, loaded is not None))
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
        need = served_need(hf_config, blocks, embedding_bytes, self.dtype.itemsize,
                           self.kv_dtype.itemsize, cc.block_size, cc.num_kv_blocks,
                           cc.kv_cache_memory, cc.swap_space)
        name = model_name(config.model.model or default_model_path())
        check_fits(need, name)
        self._bf16_blocks_fit = self._bf16_copy_fits(need, blocks, name)

    def _bf16_copy_fits(self, need: MemoryNeed, blocks: object | None, name: str) -> bool:
        """Whether 16-bit compute may serve a GGUF file's decoder-layer blocks: allowed
        (--cpu-bf16-compute auto or on), bf16 in hardware, and their bf16 copy fits beside
        `need` (the weights, KV cache and swap space) and, under auto, takes at most
        ``BF16_COPY_SHARE`` of the available memory (`memory_fit.bf16_copy_fits`); a log
        line says why where it does not."""
        if blocks is None or not self._bf16_compute or bf16_hardware() is None:
            return False
        fits, why = bf16_copy_fits(need, blocks, name, any_share=self._bf16_any_share)
        if not fits:
            log.info("16-bit compute stays off the GGUF blocks: %s", why)
        return fits

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """(input_ids [T], positions [T], metadata, logits_indices [S]) for one step of at
        least one sequence (`step_inputs.prepare_inputs`)."""
        return prepare_inputs(out.sequences, self.block_size, self.ops, self.device)

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

    def measure_rates(self, prefill_tokens: int | None = None,
                      buckets: bool = True) -> tuple[float, float]:
        """(swap bytes/s, prefill tokens/s) measured on this machine, then the warm-ups
        (`warmup.measure_rates`). Uses blocks of the empty cache as scratch: call before
        any request runs."""
        return measure_rates(self, prefill_tokens, buckets)

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
        """The name the API serves the model under (--served-model-name, else the
        checkpoint's folder or file name)."""
        return self._served_model_name or self.loaded.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loaded.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def describe(self) -> dict[str, str]:
        """What the engine_ready log line says about this runner."""
        return {"device": str(self.device), "attention_backend": self.ops.name,
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
        self.sampling.forget(out.finished_request_ids)
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
        return self.sampling.sample(sampling, logits, prompt_lps, tm)
