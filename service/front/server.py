"""FrontServer: the front app on uvicorn, on one port, for one process (`conveyor serve`).

    server = await FrontServer(engine, ServerConfig(port=0)).start()
    server.port, server.url          # ws://127.0.0.1:PORT/v1/stream
    await server.shutdown()          # graceful drain, then close()

    server = await FrontServer(None, config, starting="loading the model").start()
    ...                              # /health 503 "starting" (service/front/starting.py)
    server.attach(engine)            # from now on the front app serves every route

uvicorn (HTTP/1.1 by httptools or h11; WebSockets by the websockets library, with
Conveyor's socket settings: service/front/ws/uvicorn_protocol.py; `ws_impl`, default
$CONVEYOR_WS_IMPL or "websockets-sansio") serves `service.front.app`.
uvicorn's own signal handling is off: the caller (`service.front.serve`) owns SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn

from starlette.types import ASGIApp

from service.config import ServerConfig
from service.engine.client import EngineClient
from service.front.access import AccessPolicy
from service.front.app import STREAM_PATH, Front, build_app
from service.front.starting import StartingApp
from service.front.ws.actor import SocketActor
from service.front.ws.uvicorn_protocol import ws_protocol

log = structlog.get_logger(__name__)


class ListenError(OSError):
    """The front could not bind its host and port (``FrontServer.start``): the message says
    which and why; the command line prints it as one line."""


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its signal handling: the process's own code owns SIGTERM
    and SIGINT (the CLI here, the launcher's gate in service/cluster/gate.py)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class FrontServer:
    """Serves `engine` on `config.host:config.port` (port 0 picks a free port).

    Use `await start()`, then `port` and `url`; `await shutdown(timeout)` drains
    gracefully; `await close()` closes every socket with 1001 and stops listening.

    engine None: the port is served before the engine exists (`conveyor serve` binds it
    before loading the model): `service.front.starting.StartingApp` answers, /health 503
    {"status": "starting", "reason": "starting: " + `starting`} (or "unavailable" after
    `failed(why)`), until `attach(engine)`.
    """

    def __init__(self, engine: EngineClient | None, config: ServerConfig | None = None,
                 ws_impl: str | None = None, starting: str = "loading the model") -> None:
        self.engine = engine
        self.ws_impl = ws_impl or os.environ.get("CONVEYOR_WS_IMPL", "websockets-sansio")
        self.config = config or ServerConfig()
        self.front: Front | None = None
        self._starting = starting
        self._start_error: str | None = None
        self._asgi: ASGIApp
        if engine is not None:
            self.front = build_app(engine, self.config)
            self._asgi = self.front.app
        else:
            c = self.config
            self._asgi = StartingApp(AccessPolicy(c.api_key, c.allowed_origins),
                                     self._starting_state,
                                     lambda: self.front.app if self.front is not None else None)
        self._sock: socket.socket | None = None
        self._server: SignalFreeServer | None = None
        self._task: asyncio.Task[None] | None = None

    def _starting_state(self) -> tuple[str, bool, dict[str, Any]]:
        if self._start_error is not None:
            return self._start_error, True, {}
        return f"starting: {self._starting}", False, {}

    def attach(self, engine: EngineClient) -> None:
        """Serve `engine` from now on (the server was started without one)."""
        if self.front is not None:
            raise RuntimeError("this server already serves an engine")
        self.engine = engine
        self.front = build_app(engine, self.config)

    def failed(self, why: str) -> None:
        """The engine could not start: /health says 503 "unavailable" and why."""
        self._start_error = why

    @property
    def connections(self) -> set[SocketActor]:
        """The open WebSockets' actors."""
        return self.front.sockets.connections if self.front is not None else set()

    @property
    def refused_connections(self) -> int:
        return self.front.sockets.refused_connections if self.front is not None else 0

    async def start(self) -> FrontServer:
        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((c.host, c.port))
        except OSError as e:
            sock.close()
            hint = (" (another server listens there: choose another --port, or --port 0 for a "
                    "free one)" if e.errno == errno.EADDRINUSE else "")
            err = ListenError(f"cannot listen on {c.host}:{c.port}: {e.strerror}{hint}")
            err.errno = e.errno
            raise err from e
        sock.listen(2048)
        sock.setblocking(False)
        self._sock = sock
        config = uvicorn.Config(
            self._asgi, ws=ws_protocol(c, self.ws_impl), ws_max_size=c.max_message_bytes,
            ws_ping_interval=c.ping_interval, ws_ping_timeout=c.ping_timeout,
            ws_per_message_deflate=False, lifespan="off", log_config=None,
            access_log=False, timeout_graceful_shutdown=c.close_timeout,
            server_header=False)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self._server = server = SignalFreeServer(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="conveyor-front")
        while not server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.005)
        return self

    @property
    def port(self) -> int:
        assert self._sock is not None, "start() first"
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}{STREAM_PATH}"

    @property
    def http_url(self) -> str:
        """http://HOST:PORT (the OpenAI SDK's base_url is this + "/v1")."""
        return "http" + self.url[2:].rsplit(STREAM_PATH, 1)[0]

    async def shutdown(self, timeout: float | None = None,
                       force: asyncio.Event | None = None) -> bool:
        """Graceful drain, then `close()`.

        New requests get `shutting_down` and /health turns 503 at once; requests in flight
        may finish for `timeout` seconds (default `config.shutdown_timeout`) or until
        `force` is set, then are cancelled (each still gets its `done`, "cancelled"); the
        queued frames are sent and every socket is closed with 1001.
        Returns True when every request finished on its own.
        """
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        if self.engine is None:  # still starting: nothing in flight
            await self.close()
            return True
        assert self.front is not None
        finished = await self.engine.drain(timeout, self.config.close_timeout, force,
                                           self.front.abort_all)
        await self.close()
        log.info("shutdown_finished", all_finished=finished)
        return finished

    async def close(self) -> None:
        """Send what is queued, close every socket with 1001 and stop listening. Idempotent."""
        if self._server is None or self._task is None:
            return
        await asyncio.gather(*(conn.shutdown() for conn in list(self.connections)))
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)

    async def serve_forever(self) -> None:
        assert self._task is not None, "start() first"
        await asyncio.shield(self._task)
