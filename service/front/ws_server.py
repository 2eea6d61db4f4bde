"""The previous network front (websockets only: no streamed HTTP body, no POST), kept as
the measured baseline of `service.bench.front_cost`; `conveyor serve` runs
`service.front.server.FrontServer`. One port for the WebSocket endpoint and plain HTTP:

    ws://HOST:PORT/v1/stream   the streaming protocol (PROTOCOL.md)
    ws://HOST:PORT/v1/responses  the OpenAI Responses API's WebSocket mode (service/responses/)
    GET /                      the built-in chat page (service/static/chat.html)
    GET /health                200 {"status": "ok"} when serving; 503 {"status": "unavailable",
                               "reason": ...} while loading or draining, when the step loop
                               died or one step has run too long (never guarded)
    GET /metrics               Prometheus text format (service/metrics.py)

Every route but /health is guarded before the upgrade (service/auth.py): a browser
Origin not in `allowed_origins` gets HTTP 403, a missing or wrong API key HTTP 401.
/health stays open for load balancers and orchestrators; /metrics is guarded because
it tells traffic and model details (Prometheus scrapes with `authorization:
credentials`). Connections beyond `max_connections` are closed right after the
handshake with 1013 ("try again later"): a browser page sees that code, whereas a
refused handshake (HTTP 503) reaches its WebSocket only as 1006 with no reason.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import socket
from pathlib import Path

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from service.auth import AccessPolicy, RedactingLogger
from service.config import ServerConfig
from service.connection import Connection
from service.engine_client import EngineClient
from service.front.drain import drain
from service.responses import ResponsesConnection
from service.socket_actor import SocketActor

STREAM_PATH = "/v1/stream"
RESPONSES_PATH = "/v1/responses"
ROUTES: dict[str, type[SocketActor]] = {STREAM_PATH: Connection,
                                        RESPONSES_PATH: ResponsesConnection}
"""WebSocket routes: path -> the actor serving each socket (same auth, limits, close codes)."""
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
CLOSE_TRY_AGAIN_LATER = 1013

log = structlog.get_logger(__name__)


def _json_response(conn: ServerConnection, status: http.HTTPStatus, body: dict) -> Response:
    resp = conn.respond(status, json.dumps(body) + "\n")
    resp.headers["Content-Type"] = "application/json"
    return resp


class ConveyorServer:
    """Serves `engine` on `config.host:config.port` (port 0 picks a free port).

    Use `await start()`, then `port` and `url`; `await shutdown(timeout)` drains
    gracefully; `await close()` closes every socket with 1001 and stops listening.
    """

    def __init__(self, engine: EngineClient, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.access = AccessPolicy(self.config.api_key, self.config.allowed_origins)
        self.connections: set[SocketActor] = set()
        self.refused_connections = 0
        self._server: Server | None = None

    async def start(self) -> ConveyorServer:
        c = self.config
        self._server = await serve(
            self._handle, c.host, c.port, process_request=self._http,
            max_size=c.max_message_bytes, write_limit=c.write_limit_bytes,
            ping_interval=c.ping_interval, ping_timeout=c.ping_timeout,
            close_timeout=c.close_timeout,
            logger=RedactingLogger(logging.getLogger("websockets.server")),
        )
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}{STREAM_PATH}"

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
        finished = await drain(self.engine, timeout, self.config.close_timeout, force,
                               self._abort_all)
        await self.close()
        log.info("shutdown_finished", all_finished=finished)
        return finished

    def _abort_all(self) -> None:
        """Cancel every request of every connection (drain's last resort)."""
        for conn in list(self.connections):
            conn.abort_all()

    async def close(self) -> None:
        """Send what is queued, close every socket with 1001 and stop listening. Idempotent."""
        if self._server is None:
            return
        await asyncio.gather(*(conn.shutdown() for conn in list(self.connections)))
        self._server.close()  # closes sockets opened meanwhile (1001) and stops listening
        await self._server.wait_closed()

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.serve_forever()

    def _http(self, conn: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        if path == "/health":
            ok, why = self.engine.health()
            if ok:
                return _json_response(conn, http.HTTPStatus.OK,
                                      {"status": "ok", "model": self.engine.model_name})
            return _json_response(conn, http.HTTPStatus.SERVICE_UNAVAILABLE,
                                  {"status": "unavailable", "reason": why})
        refused = self._refuse(conn, request, path, query)
        if refused is not None:
            return refused
        if path in ROUTES:
            return None  # go on with the WebSocket handshake
        if path in ("/", "/index.html"):
            resp = conn.respond(http.HTTPStatus.OK, CHAT_PAGE.read_text(encoding="utf-8"))
            resp.headers["Content-Type"] = "text/html; charset=utf-8"
            resp.headers["Cache-Control"] = "no-cache"
            return resp
        if path == "/metrics" and self.engine.metrics is not None:
            resp = conn.respond(http.HTTPStatus.OK, self.engine.metrics.render().decode())
            resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
            return resp
        return _json_response(conn, http.HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})

    def _refuse(self, conn: ServerConnection, request: Request, path: str,
                query: str) -> Response | None:
        """HTTP 403 for a foreign browser Origin, 401 without the API key; else None."""
        origin = request.headers.get("Origin")
        if not self.access.origin_allowed(origin):
            log.warning("request_refused", status=403, route=path, origin=origin,
                        peer=str(conn.remote_address))
            return _json_response(conn, http.HTTPStatus.FORBIDDEN,
                                  {"error": f"origin {origin!r} is not allowed"})
        if not self.access.key_ok(request.headers.get("Authorization"), query):
            log.warning("request_refused", status=401, route=path, peer=str(conn.remote_address))
            resp = _json_response(conn, http.HTTPStatus.UNAUTHORIZED, {
                "error": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                         "or add ?api_key=<key> to the URL"})
            resp.headers["WWW-Authenticate"] = 'Bearer realm="conveyor"'
            return resp
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        limit = self.config.max_connections
        if len(self.connections) >= limit:
            self.refused_connections += 1
            log.warning("connection_refused", limit=limit, peer=str(ws.remote_address))
            await ws.close(CLOSE_TRY_AGAIN_LATER,
                           f"too many connections (limit {limit}); try again later")
            return
        if self.config.socket_send_buffer_bytes is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                self.config.socket_send_buffer_bytes)
        path = ws.request.path.partition("?")[0] if ws.request is not None else STREAM_PATH
        conn = ROUTES.get(path, Connection)(ws, self.engine, self.config)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
