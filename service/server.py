"""The network front end: one port for the WebSocket endpoint and plain HTTP.

    ws://HOST:PORT/v1/stream   the streaming protocol (PROTOCOL.md)
    GET /                      the built-in chat page (service/static/chat.html)
    GET /health                200 {"status": "ok"} when ready, 503 otherwise
    GET /metrics               Prometheus text format (service/metrics.py)
"""

from __future__ import annotations

import http
import json
from pathlib import Path

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from service.config import ServerConfig
from service.connection import Connection
from service.engine import Engine

STREAM_PATH = "/v1/stream"
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"


def _json_response(conn: ServerConnection, status: http.HTTPStatus, body: dict) -> Response:
    resp = conn.respond(status, json.dumps(body) + "\n")
    resp.headers["Content-Type"] = "application/json"
    return resp


class ConveyorServer:
    """Serves `engine` on `config.host:config.port` (port 0 picks a free port).

    Use `await start()`, then `port` and `url`; `await close()` stops accepting and
    closes every socket.
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self._server: Server | None = None

    async def start(self) -> ConveyorServer:
        self._server = await serve(
            self._handle, self.config.host, self.config.port,
            process_request=self._http, max_size=self.config.max_message_bytes,
            ping_interval=20, ping_timeout=60,
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

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.serve_forever()

    def _http(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == STREAM_PATH:
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
        if path == "/health":
            if self.engine.ready and self.engine.accepting:
                return _json_response(conn, http.HTTPStatus.OK,
                                      {"status": "ok", "model": self.engine.model_name})
            return _json_response(conn, http.HTTPStatus.SERVICE_UNAVAILABLE,
                                  {"status": "unavailable"})
        return _json_response(conn, http.HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})

    async def _handle(self, ws: ServerConnection) -> None:
        await Connection(ws, self.engine, self.config).run()
