"""What the front answers before its engine exists (the model is loading), as an ASGI app.

Both servers bind their port before the model is loaded, so that /health answers from
the first moment: `conveyor serve` (FrontServer started without an engine, service/front/serve.py)
and the Ray ingress, whose RemoteEngine exists once a replica has loaded the model
(service/cluster/ingress.py). Until then (afterwards the front app, service/front/app.py,
serves every route) this app answers:

    GET /health        503 {"status": "starting", "reason": "starting: ...", ...counts}
                       (on Ray the counts are "replicas": k, "expected_replicas": N;
                       "unavailable" and the error once the start failed); never guarded
    WS  any path       accepted, then closed 1013 "the model is loading; try again later"
    /v1/... (HTTP)     503 with OpenAI's error body (code "model_loading") and Retry-After
    anything else      503 {"error": reason} with Retry-After

Every route but /health keeps the front's guard (403 a foreign Origin, 401 a wrong key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from protocol import ShuttingDown
from service.front.access import WWW_AUTHENTICATE, AccessPolicy, refusal, refuse_socket
from service.front.openai.errors import OpenAIError

RETRY_AFTER_S = 5
LOADING = "the model is loading; try again later"
FAILED = "the engine failed to start"


class StartingApp:
    """The answers above until `serving()` returns the front app, which serves every
    request from then on.

    Args:
        access: the front's access rule (API key, allowed Origins).
        state: () -> (reason, failed, counts) now: counts are extra /health fields (on
            Ray {"replicas": k, "expected_replicas": N}); failed: the start failed
            (reason says why).
        serving: () -> the front app once it exists, else None.
    """

    def __init__(self, access: AccessPolicy,
                 state: Callable[[], tuple[str, bool, dict[str, Any]]],
                 serving: Callable[[], ASGIApp | None]) -> None:
        self.access = access
        self.state = state
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.serving()
        if app is not None and scope["type"] != "lifespan":
            await app(scope, receive, send)
        elif scope["type"] == "lifespan":  # nothing to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "websocket":
            await self._socket(WebSocket(scope, receive, send))
        else:
            await self._http(Request(scope, receive))(scope, receive, send)

    async def _socket(self, ws: WebSocket) -> None:
        if await refuse_socket(self.access, ws):
            return
        await ws.accept()
        _, failed, _ = self.state()
        # unavailable for now, as a draining server is: 1013 "try again later"
        await ws.close(ShuttingDown.close_code, FAILED if failed else LOADING)

    def _http(self, request: Request) -> Response:
        reason, failed, counts = self.state()
        path = request.url.path
        if path == "/health":
            return JSONResponse({"status": "unavailable" if failed else "starting",
                                 "reason": reason, **counts}, 503)
        openai = path.startswith("/v1/")
        refused = refusal(self.access, request.headers, request.url.query, path)
        if refused is not None:
            status, message = refused
            headers = WWW_AUTHENTICATE if status == 401 else None
            if openai:
                code = "invalid_api_key" if status == 401 else "origin_not_allowed"
                return JSONResponse(OpenAIError(status, message, code=code).body(), status,
                                    headers=headers)
            return JSONResponse({"error": message}, status, headers=headers)
        if openai:
            return OpenAIError(503, reason, code="model_loading",
                               retry_after_s=RETRY_AFTER_S).response()
        return JSONResponse({"error": reason}, 503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})
