"""The cluster's front door: a FastAPI ingress deployment behind Ray Serve's HTTP proxy.

    ws://HOST:PORT/v1/stream   the streaming protocol (PROTOCOL.md), served by the same
                               Connection actor as `conveyor serve`, over a RemoteEngine
    ws://HOST:PORT/v1/responses  the OpenAI Responses API's WebSocket mode, served by the
                               same ResponsesConnection actor as `conveyor serve`
    GET /health                200 {"status": "ok", "replicas": N} when some replica is
                               routable and the ingress accepts requests, else 503
    GET /metrics               the ingress's metrics and every replica's engine metrics
                               (label `replica`), Prometheus text
    GET /                      the built-in chat page

Every route but /health is guarded like `conveyor serve`'s (service/auth.py): a foreign
browser Origin gets 403, a missing or wrong API key 401. Sockets beyond
`max_connections` are closed with 1013 right after the handshake.

Each WebSocket protocol is one route handing its actor class to `_serve_socket` (any
`service.socket_actor.SocketActor`: built as `Actor(socket, engine, server_config)`,
with `run()`, `abort_all()` and `shutdown()`).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations
# (WebSocket, Request) at class-definition time, through Ray Serve's class-based view.
import asyncio
import http
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from service.auth import AccessPolicy
from service.cluster.asgi_socket import AsgiSocket
from service.cluster.ingress_metrics import IngressMetrics
from service.cluster.remote_engine import RemoteEngine
from service.cluster.registry import routers_for
from service.config import ServerConfig
from service.connection import Connection
from service.responses import ResponsesConnection

log = structlog.get_logger(__name__)

CHAT_PAGE = Path(__file__).resolve().parent.parent / "static" / "chat.html"
CLOSE_TRY_AGAIN_LATER = 1013

app = FastAPI(title="Conveyor", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(app)
class Ingress:
    """Serves the WebSocket protocol over the EngineReplica deployment `engine`.

    Args:
        engine: DeploymentHandle of the EngineReplica deployment.
        server_config: limits and access (the `conveyor serve` network flags; host and
            port are the proxy's, set when Serve starts).
        max_waiting_requests: most prompts tokenized at once here.
    """

    async def __init__(self, engine: Any, server_config: ServerConfig,
                       max_waiting_requests: int = 1024) -> None:
        self.config = server_config
        self.access = AccessPolicy(server_config.api_key, server_config.allowed_origins)
        self._deployment = engine.deployment_name
        info = await engine.info.remote()  # waits until a replica is up
        self.metrics = IngressMetrics(info.model_name, decisions=self._decisions)
        self.engine = RemoteEngine(engine, info, self.metrics, max_waiting_requests)
        self._handle = engine
        self.connections: set[Any] = set()
        log.info("ingress_ready", model=info.model_name, deployment=self._deployment)

    # ---- HTTP --------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        replicas = len(self._replica_ids())
        if self.engine.accepting and replicas:
            return JSONResponse({"status": "ok", "model": self.engine.model_name,
                                 "replicas": replicas})
        return JSONResponse({"status": "unavailable", "replicas": replicas},
                            status_code=http.HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        refused = self._refuse(request.headers, request.url.query)
        if refused is not None:
            return refused
        body = await self.engine.metrics_text()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def chat_page(self, request: Request) -> Response:
        refused = self._refuse(request.headers, request.url.query)
        if refused is not None:
            return refused
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-cache"})

    # ---- WebSocket ---------------------------------------------------------------------
    @app.websocket("/v1/stream")
    async def stream(self, ws: WebSocket) -> None:
        await self._serve_socket(ws, Connection)

    @app.websocket("/v1/responses")
    async def responses(self, ws: WebSocket) -> None:
        await self._serve_socket(ws, ResponsesConnection)

    async def _serve_socket(self, ws: WebSocket, actor: Callable[..., Any]) -> None:
        """Check access, accept, apply the connection limit, then run `actor` on the socket."""
        refused = self._refuse(ws.headers, ws.url.query)
        if refused is not None:
            try:
                await ws.send_denial_response(refused)
            except RuntimeError:  # the server cannot send HTTP responses to WebSockets
                await ws.close(1008, "refused")
            return
        await ws.accept()
        socket = AsgiSocket(ws, self.config.max_message_bytes)
        limit = self.config.max_connections
        if len(self.connections) >= limit or not self.engine.accepting:
            await socket.close(CLOSE_TRY_AGAIN_LATER, f"too many connections (limit {limit}) "
                               "or shutting down; try again later")
            return
        conn = actor(socket, self.engine, self.config)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    def _refuse(self, headers: Any, query: str) -> Response | None:
        origin = headers.get("origin")
        if not self.access.origin_allowed(origin):
            log.warning("request_refused", status=403, origin=origin)
            return JSONResponse({"error": f"origin {origin!r} is not allowed"},
                                status_code=http.HTTPStatus.FORBIDDEN)
        if not self.access.key_ok(headers.get("authorization"), query):
            log.warning("request_refused", status=401)
            return JSONResponse(
                {"error": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                          "or add ?api_key=<key> to the URL"},
                status_code=http.HTTPStatus.UNAUTHORIZED,
                headers={"WWW-Authenticate": 'Bearer realm="conveyor"'})
        return None

    # ---- drain (called by `conveyor serve --replicas` on SIGTERM / SIGINT) -------------
    async def drain(self, timeout: float | None = None) -> bool:
        """Graceful end, as ConveyorServer.shutdown: /health 503 and new requests get
        `shutting_down` at once; requests in flight get `timeout` seconds (default
        shutdown_timeout), then are cancelled (each still gets its done); every socket is
        closed with 1001. Returns True when every request finished on its own."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        self.engine.begin_shutdown()
        log.info("shutdown_started", requests_in_flight=self.engine.num_unfinished,
                 timeout_s=timeout)
        finished = await self.engine.wait_idle(timeout)
        if not finished:
            for conn in list(self.connections):
                conn.abort_all()
            await self.engine.wait_idle(self.config.close_timeout)
        await asyncio.gather(*(conn.shutdown() for conn in list(self.connections)),
                             return_exceptions=True)
        log.info("shutdown_finished", all_finished=finished)
        return finished

    async def __del__(self) -> None:
        await self.engine.close()

    # ---- replicas --------------------------------------------------------------------------
    def _replica_ids(self) -> list[str]:
        return self.engine.replica_ids()

    def _decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for router in routers_for(self._deployment):
            for reason, n in router.decisions.items():
                total[reason] = total.get(reason, 0) + n
        return total
