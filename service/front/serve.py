"""`conveyor serve` in one process: bind the port, load the model, serve, drain on a signal.

The command line (`service.cli`) parses the flags (`service.engine_args.build_parser`) and
runs `serve(args)` on the event loop it chose; `conveyor serve --replicas N` goes to
`service.cluster.launch` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from service.engine_args import engine_config, server_config
from service.gc_heap import freeze_startup_heap

__all__ = ["on_shutdown_signals", "serve"]


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


async def serve(a: argparse.Namespace) -> None:
    """Bind the port, load, serve until SIGTERM/SIGINT, then drain: /health 503, new
    requests get `shutting_down`, requests in flight get --shutdown-timeout seconds,
    sockets close 1001.

    The port is served from the start: while the model loads, /health answers 503
    "starting" and requests are refused with a retry hint (service/front/starting.py).
    A signal while loading stops at once: the load runs in a worker thread that cannot be
    interrupted, so the process exits without waiting for it (nothing is in flight)."""
    from service.engine.engine import Engine
    from service.front.server import FrontServer

    net = server_config(a)
    cfg = engine_config(a)
    stop, force = asyncio.Event(), asyncio.Event()
    on_shutdown_signals(stop, force)
    model = a.model or "SmolLM2-135M-Instruct (default)"
    server = await FrontServer(None, net, starting=f"loading {model}").start()
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
              "(chat/completions, completions, responses, models)", flush=True)
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
