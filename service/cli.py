"""`conveyor` command line: `conveyor serve [options]`, `conveyor chat [options]`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from service.cluster.config import add_cluster_args
from service.engine_args import add_engine_args, add_server_args, engine_config, server_config

__all__ = ["add_engine_args", "build_parser", "engine_config", "main", "server_config"]


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
    add_server_args(serve)
    add_engine_args(serve)
    add_cluster_args(serve)
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
    """Bind the port, load, serve until SIGTERM/SIGINT, then drain: /health 503, new
    requests get `shutting_down`, requests in flight get --shutdown-timeout seconds,
    sockets close 1001.

    The port is served from the start: while the model loads, /health answers 503
    "starting" and requests are refused with a retry hint (service/front/starting.py).
    A signal while loading stops at once: the load runs in a worker thread that cannot be
    interrupted, so the process exits without waiting for it (nothing is in flight)."""
    from service.engine import Engine
    from service.gc_heap import freeze_startup_heap
    from service.server import ConveyorServer

    net = server_config(a)
    cfg = engine_config(a)
    stop, force = asyncio.Event(), asyncio.Event()
    on_shutdown_signals(stop, force)
    model = a.model or "SmolLM2-135M-Instruct (default)"
    server = await ConveyorServer(None, net, starting=f"loading {model}").start()
    print(f"conveyor: loading {model} ...; health at http://{a.host}:{server.port}/health "
          "(503 until the model is loaded)", flush=True)
    engine = Engine(cfg)
    loading = asyncio.ensure_future(engine.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # signalled while loading
        await server.close()
        print("conveyor: stopped while loading", flush=True)
        sys.stderr.flush()
        os._exit(0)
    stopping.cancel()
    try:
        loading.result()
    except BaseException as e:
        server.failed(f"the engine failed to start: {type(e).__name__}: {e}")
        await server.close()
        await engine.close()
        raise
    try:
        freeze_startup_heap("conveyor serve")  # before the first request: no stall later
        server.attach(engine)
        mode = f" ({cfg.model.quantization})" if cfg.model.quantization not in (None, "auto") \
            else ""
        print(f"conveyor: serving {engine.model_name}{mode} at {server.url}", flush=True)
        print(f"conveyor: OpenAI Responses WebSocket mode at "
              f"{server.url.rsplit('/v1/', 1)[0]}/v1/responses (openai SDK: base_url="
              f"http://{a.host}:{server.port}/v1)", flush=True)
        print(f"conveyor: OpenAI HTTP API at http://{a.host}:{server.port}/v1 "
              "(chat/completions, completions, models)", flush=True)
        print(f"conveyor: health at http://{a.host}:{server.port}/health", flush=True)
        try:
            await stop.wait()
            print(f"conveyor: shutting down: {engine.num_unfinished} requests in flight get "
                  f"{net.shutdown_timeout:g} s (a second signal cancels them now)", flush=True)
            await server.shutdown(force=force)
        finally:
            await server.close()
    finally:
        await engine.close()
    print("conveyor: stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chat":
        from protocol.chat import main as chat_main
        return chat_main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from service.bench import missing_extra

        problem = missing_extra()
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        from service.bench.cli import main as bench_main
        return bench_main(argv[1:]) or 0
    a = build_parser().parse_args(argv)
    from service.logs import configure_logging

    configure_logging(a.log_level)
    if a.replicas is not None:
        from service.cluster import ClusterUnavailable, require_ray

        try:
            require_ray()
            from service.cluster.launch import serve_cluster

            return serve_cluster(a)
        except (ClusterUnavailable, ValueError) as e:  # one line: the extra, or a bad flag
            print(f"conveyor: {e}", file=sys.stderr)
            return 2
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
