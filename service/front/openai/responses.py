"""`POST /v1/responses`: the OpenAI Responses API over plain HTTP, streamed or not.

The same create body as the WebSocket mode (protocol/responses_request.py's
`parse_create_body`), the same admission (service/front/ws/responses/admit.py) and the
same events (service/front/ws/responses/run.py), on another transport:

    stream: true    SSE, one `event: <type>` / `data: <event JSON>` pair per event, the
                    WebSocket mode's events in the same order and numbering; an engine
                    failure is OpenAI's flat `error` event ({"type": "error", "code",
                    "message", "param", "sequence_number"}) before `response.failed`
    otherwise       one JSON Response object (status "completed" or "incomplete"); an
                    engine failure is a 500 error body

Refusals before anything streams are OpenAI's error bodies with their status (400 with
`param` naming the field, 404 another model or an unknown previous response, 413, 415,
429 / 503 with Retry-After), logged once as `request_refused`. A client that disconnects
cancels its response (its KV blocks return within a step).

`previous_response_id` continues a stored response of this route from its exact tokens,
as on a socket, but from one store for the whole route (`--responses-http-max-stored`,
`--responses-http-max-stored-tokens`; the oldest dropped first) instead of one per
connection. `store: false` keeps nothing (over HTTP there is no connection whose latest
response could be continued). Responses of the WebSocket mode and of this route do not
see each other's.

`GET /v1/responses/{id}` returns a stored response of this route as it was served (the
Response object; `stream=true` there is refused: nothing is replayed), and
`DELETE /v1/responses/{id}` forgets it (`{"id", "object": "response", "deleted": true}`);
an id the store does not hold (never stored, `store: false`, failed, cancelled, or dropped
as the oldest) is a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import Done, ProtocolError
from protocol.responses import (ErrorEvent, ResponseCompleted, ResponseFailed,
                                ResponseIncomplete)
from protocol.responses_request import CreateRequest, ResponsesError, parse_create_body
from service.front.openai.routes import log_refusal, read_json_body
from service.front.openai.errors import OpenAIError, from_protocol
from service.front.ws.responses.admit import admit, check_model, context_of, from_protocol_error
from service.front.ws.responses.run import ResponseRun, new_response_id
from service.front.ws.responses.store import ResponseStore

log = structlog.get_logger(__name__)

__all__ = ["RESPONSES_HTTP_PATH", "ResponsesHttp"]

RESPONSES_HTTP_PATH = "/v1/responses"
TERMINAL = (ResponseCompleted, ResponseIncomplete, ResponseFailed)
_encode = msgspec.json.Encoder().encode


def _openai_error(e: ResponsesError) -> OpenAIError:
    return OpenAIError(e.status, e.message, param=e.param, code=e.code)


def _sse(event: Struct) -> bytes:
    """One SSE event; the WebSocket mode's error event in the HTTP API's flat shape."""
    if isinstance(event, ErrorEvent):
        data = _encode({"type": "error", "code": event.error.code,
                        "message": event.error.message, "param": event.error.param,
                        "sequence_number": event.sequence_number})
        return b"event: error\ndata: " + data + b"\n\n"
    kind = type(event).__struct_config__.tag
    return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class _HttpRun:
    """One response of this route: its run, the queue its events land in, its key."""

    def __init__(self, run_id: str, key: str) -> None:
        self.id, self.key = run_id, key
        self.events: asyncio.Queue[Struct] = asyncio.Queue()
        self.run: ResponseRun | None = None
        self.done = False
        self.final: Any = None  # the Response of the terminal event

    def put(self, event: Struct) -> bool:
        self.events.put_nowait(event)
        if isinstance(event, TERMINAL):
            self.final = event.response
        return True


class ResponsesHttp:
    """The route, over the OpenAI routes' engine, access checks and metrics (`routes`:
    service.front.openai.routes.OpenAIRoutes)."""

    def __init__(self, routes: Any) -> None:
        self.routes = routes
        self.engine = routes.engine
        config = routes.config
        self.store = ResponseStore(config.responses_http_max_stored,
                                   config.responses_http_max_stored_tokens)
        self.live: dict[str, _HttpRun] = {}
        self._special_ids: frozenset[int] | None = None

    def route_list(self) -> list[Route]:
        return [Route(RESPONSES_HTTP_PATH, self.create, methods=["POST"]),
                Route(RESPONSES_HTTP_PATH + "/{response_id}", self.stored,
                      methods=["GET", "DELETE"])]

    def abort_all(self) -> None:
        """Cancel every response in flight (a forced shutdown)."""
        for live in list(self.live.values()):
            self.engine.abort(live.key)

    def _refused(self, e: OpenAIError, response_id: str) -> Response:
        self.routes._count(RESPONSES_HTTP_PATH, e.status)
        log_refusal(RESPONSES_HTTP_PATH, e, response_id)
        return self.routes._error(e)

    async def create(self, request: Request) -> Response:
        response_id = new_response_id()
        live = _HttpRun(response_id, f"http/{response_id}")
        received = time.monotonic()
        req: CreateRequest | None = None
        try:
            self.routes._guard(request)
            body = await read_json_body(request, self.routes.config.max_message_bytes)
            req = parse_create_body(body)
            run = self._run(live, req)
            self.live[live.key] = live
            await admit(self.engine, run, self._previous(req), request_id=live.key,
                        connection_id=response_id, received=received)
        except ResponsesError as e:
            self.live.pop(live.key, None)
            return self._refused(_openai_error(e), response_id)
        except OpenAIError as e:
            self.live.pop(live.key, None)
            return self._refused(e, response_id)
        except ProtocolError as e:
            self.live.pop(live.key, None)
            assert req is not None
            refusal = from_protocol_error(e, req)
            error = OpenAIError(refusal.status, refusal.message, param=refusal.param,
                                code=refusal.code,
                                retry_after_s=from_protocol(e, {}).retry_after_s)
            return self._refused(error, response_id)
        except BaseException:
            self.live.pop(live.key, None)
            raise
        run.start()
        watcher = asyncio.get_running_loop().create_task(self._watch(live, request))
        self.routes._count(RESPONSES_HTTP_PATH, 200)
        if req.stream:
            return StreamingResponse(self._streamed(live, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        try:
            final = await self._final(live)
        finally:
            watcher.cancel()
            self._end(live)
        if final.status == "failed":
            message = final.error.message if final.error is not None else "failed"
            return self.routes._error(OpenAIError(500, message, code="server_error"))
        return Response(_encode(final), media_type="application/json")

    async def stored(self, request: Request) -> Response:
        """GET (the Response as served) or DELETE (forget it) of a stored response."""
        response_id = request.path_params["response_id"]
        path = RESPONSES_HTTP_PATH + "/{id}"
        try:
            self.routes._guard(request)
            if request.method == "GET" and request.query_params.get("stream") in ("true", "1"):
                raise OpenAIError(400, "stream=true on a stored response is not served: "
                                  "nothing is replayed; retrieve it without stream",
                                  param="stream", code="unsupported_parameter")
            entry = self.store.get(response_id)
            if entry is None or entry.body is None:
                raise OpenAIError(404, f"Response with id '{response_id}' not found (this "
                                  f"route keeps stored responses of its own, the oldest "
                                  f"dropped first).", param="response_id", code="not_found")
        except OpenAIError as e:
            self.routes._count(path, e.status)
            log_refusal(path, e, response_id)
            return self.routes._error(e)
        self.routes._count(path, 200)
        if request.method == "DELETE":
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return Response(entry.body, media_type="application/json")

    def _run(self, live: _HttpRun, req: CreateRequest) -> ResponseRun:
        check_model(req, self.engine.model_name)
        defaults = self.engine.sampling_defaults
        live.run = ResponseRun(
            live.id, req, self.engine.model_name,
            temperature=req.temperature if req.temperature is not None else defaults.temperature,
            top_p=req.top_p if req.top_p is not None else defaults.top_p,
            put=live.put, on_finish=self._finished)
        return live.run

    def _previous(self, req: CreateRequest):
        if req.previous_response_id is None:
            return None
        previous = self.store.get(req.previous_response_id)
        if previous is None:
            raise ResponsesError(
                f"Previous response with id '{req.previous_response_id}' not found (this "
                f"route keeps stored responses of its own, the oldest dropped first).",
                code="previous_response_not_found", param="previous_response_id")
        return previous

    def _finished(self, run: ResponseRun, done: Done) -> None:
        """The engine's Done for `run`: keep its context when it asked to be stored."""
        live = self.live.get(f"http/{run.id}")
        if live is not None:
            live.done = True
        if not run.request.store:
            return
        if self._special_ids is None:
            self._special_ids = frozenset(self.engine.tokenizer.all_special_ids)
        context = context_of(run, done, self._special_ids)
        if context is not None:
            final = live.final if live is not None else None
            body = _encode(final) if final is not None else None
            self.store.put(dataclasses.replace(context, body=body))

    async def _watch(self, live: _HttpRun, request: Request) -> None:
        """Cancel the response when the client disconnects (the body was read already)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not live.done:
                    log.info("http_client_disconnected", request_id=live.id)
                    self.engine.abort(live.key)
                return

    def _end(self, live: _HttpRun) -> None:
        self.live.pop(live.key, None)
        if not live.done:
            self.engine.abort(live.key)

    async def _final(self, live: _HttpRun):
        while True:
            event = await live.events.get()
            if isinstance(event, TERMINAL):
                return event.response

    async def _streamed(self, live: _HttpRun, watcher: asyncio.Task[None]
                        ) -> AsyncIterator[bytes]:
        try:
            while True:
                event = await live.events.get()
                yield _sse(event)
                if isinstance(event, TERMINAL):
                    return
        finally:
            watcher.cancel()
            self._end(live)
