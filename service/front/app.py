"""The one front app: every route, over any EngineClient.

    GET  /health                200 {"status": "ok", "model": ...} when serving (plus the
                                engine's health_info, e.g. "replicas" on Ray); 503
                                {"status": "starting" or "unavailable", "reason": ...}
                                otherwise ("starting" while the reason starts so); never
                                guarded (load balancers, orchestrators)
    GET  /metrics               Prometheus text (the engine's, or every replica's)
    GET  /                      the built-in chat page (service/front/static/chat.html)
    WS   /v1/stream             the streaming protocol (PROTOCOL.md)
    WS   /v1/responses          the OpenAI Responses API's WebSocket mode
    GET  /v1/models             \\
    GET  /v1/models/{model}      | the OpenAI HTTP API (service/front/openai/)
    POST /v1/chat/completions    |
    POST /v1/completions         |
    POST /v1/responses          /  (the Responses API over HTTP, beside its WebSocket mode)

Every route but /health is guarded (service/front/access.py); the HTTP routes answer CORS
(preflights, Access-Control-Allow-Origin) for the allowed Origins. `build_app` makes the same
app for `conveyor serve` (an Engine behind it) and the Ray ingress (a RemoteEngine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from service.config import ServerConfig
from service.engine.client import EngineClient
from service.front.access import WWW_AUTHENTICATE, AccessPolicy, refusal
from service.front.openai.errors import OpenAIError
from service.front.openai.responses import ResponsesHttp
from service.front.openai.routes import OpenAIRoutes
from service.front.ws.responses import ResponsesConnection
from service.front.ws.routes import SocketRoutes
from service.front.ws.stream import Connection

STREAM_PATH = "/v1/stream"
RESPONSES_PATH = "/v1/responses"
CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Front:
    """What `build_app` made: the app and its parts (the server drains the sockets)."""

    app: Starlette
    sockets: SocketRoutes
    openai: OpenAIRoutes
    responses_http: ResponsesHttp

    def abort_all(self) -> None:
        """Cancel every request of every socket and HTTP request (a drain's last resort;
        each still ends with its Done, "cancelled")."""
        for conn in list(self.sockets.connections):
            conn.abort_all()
        self.openai.abort_all()
        self.responses_http.abort_all()


def build_app(engine: EngineClient, config: ServerConfig,
              refuse_while_draining: bool = False) -> Front:
    """The Starlette app serving `engine` with `config`'s limits and access."""
    access = AccessPolicy(config.api_key, config.allowed_origins)
    sockets = SocketRoutes(engine, config, access, refuse_while_draining)
    openai = OpenAIRoutes(engine, config, access)
    responses_http = ResponsesHttp(openai)  # POST /v1/responses, over the OpenAI routes' parts

    def guarded(request: Request) -> Response | None:
        refused = refusal(access, request.headers, request.url.query, request.url.path)
        if refused is None:
            return None
        status, message = refused
        return JSONResponse({"error": message}, status,
                            headers=WWW_AUTHENTICATE if status == 401 else None)

    async def health(request: Request) -> Response:
        ok, why = engine.health()
        if ok:
            return JSONResponse({"status": "ok", "model": engine.model_name,
                                 **engine.health_info()})
        status = "starting" if why.startswith("starting") else "unavailable"
        return JSONResponse({"status": status, "reason": why, **engine.health_info()}, 503)

    async def metrics(request: Request) -> Response:
        return guarded(request) or Response(await engine.metrics_text(), media_type=METRICS_TYPE)

    async def chat_page(request: Request) -> Response:
        return guarded(request) or HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"),
                                                headers={"Cache-Control": "no-cache"})

    async def not_found(request: Request, exc: Exception) -> Response:
        path = request.url.path
        message = f"no route {path}"
        if path == STREAM_PATH:  # plain HTTP to a WebSocket route
            message = f"{path} is a WebSocket route: connect to ws://HOST:PORT{path}"
        return OpenAIError(404, message, code="not_found").response()

    async def not_allowed(request: Request, exc: Exception) -> Response:
        response = OpenAIError(405, f"{request.method} is not allowed on {request.url.path}",
                               code="method_not_allowed").response()
        response.headers.update(getattr(exc, "headers", None) or {})  # Allow: the methods
        return response

    async def stream(ws: WebSocket) -> None:
        await sockets.serve(ws, Connection)

    async def responses(ws: WebSocket) -> None:
        await sockets.serve(ws, ResponsesConnection)

    routes = [Route("/health", health), Route("/metrics", metrics),
              Route("/", chat_page), Route("/index.html", chat_page),
              WebSocketRoute(STREAM_PATH, stream), WebSocketRoute(RESPONSES_PATH, responses),
              *openai.routes(), *responses_http.route_list()]
    # CORS for browser pages calling the HTTP routes (a WebSocket needs none): the Origins
    # --allowed-origins lists, every one when it lists none (as the guard allows), preflights
    # answered before the guard (they carry no key); the guard still refuses other Origins.
    cors = Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins) or ["*"],
                      allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)
    app = Starlette(routes=routes, middleware=[cors],
                    exception_handlers={404: not_found, 405: not_allowed})
    return Front(app, sockets, openai, responses_http)
