"""The OpenAI HTTP routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /v1/models/{model} (the SDK's `models.retrieve`). POST /v1/responses is
service/front/openai/responses.py's, built by the app over this class's access checks,
metrics and body reading.

Each request: access (401 / 403) -> body (`read_json_body`: 415 not `application/json`,
413 over `max_message_bytes`, 400 not JSON or nested too deep) -> Plan (400 naming the field, 404 another model) -> every choice admitted by the
engine (its refusal: 400 / 429 / 503 with Retry-After) -> a JSON body, or SSE
(`text/event-stream`: `data: {chunk}` lines, then `data: [DONE]`). A client that
disconnects aborts its choices. `/metrics` counts each request by route and status
(`conveyor:http_requests_total`); every refusal is one log line (`http_request_refused`:
route, status, code, param, request id).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.config import ServerConfig
from service.engine.client import EngineClient
from service.front.access import WWW_AUTHENTICATE, AccessPolicy, refusal
from service.front.openai.completions import completion_plan
from service.front.openai.errors import OpenAIError
from service.front.openai.request import Plan, chat_plan, check_model_name
from service.front.openai.run import Run, new_run_id
from service.front.refusals import log_refused

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
JSON_TYPE = "application/json"


def check_media_type(content_type: str | None) -> None:
    """Raises OpenAIError 415 `unsupported_media_type` unless `content_type` is
    application/json (parameters such as `charset` allowed), as a JSON API answers a
    form post."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON_TYPE:
        shown = f"{content_type[:80]!r}" if content_type else "none"
        raise OpenAIError(415, f"the body must be JSON sent with Content-Type: {JSON_TYPE} "
                          f"(got {shown})", code="unsupported_media_type")


def decode_json(data: bytes) -> Any:
    """The decoded body. Raises OpenAIError 400 `invalid_json`: not JSON, or nested deeper
    than msgspec decodes (it raises RecursionError at about 1,000 levels: a 2 kB body),
    answered like any other 400 so the keep-alive connection stays usable (it used to be
    a plain-text 500 and a reset connection)."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"the body is not valid JSON: {e}", code="invalid_json") \
            from None
    except RecursionError:
        raise OpenAIError(400, "the body is nested too deeply (arrays and objects inside "
                          "one another beyond the decoder's depth limit)",
                          code="invalid_json") from None


async def read_json_body(request: Request, limit: int) -> Any:
    """The request's JSON body. Raises OpenAIError: 415 (`check_media_type`), 413
    `request_too_large` over `limit` bytes (by its Content-Length, or while it streams in),
    400 (`decode_json`)."""
    check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"the body ({declared} bytes) is over the limit of {limit}",
                          code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"the body is over the limit of {limit} bytes",
                              code="request_too_large")
        chunks.append(chunk)
    return decode_json(b"".join(chunks))


def log_refusal(route: str, e: OpenAIError, request_id: str | None) -> None:
    """One `request_refused` line for an HTTP refusal."""
    log_refused(route, e.code, request_id, status=e.status, param=e.param, message=e.message)


class OpenAIRoutes:
    """The OpenAI HTTP API over `engine`; `runs` are the requests in flight."""

    def __init__(self, engine: EngineClient, config: ServerConfig, access: AccessPolicy) -> None:
        self.engine = engine
        self.config = config
        self.access = access
        self.runs: set[Run] = set()
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [Route(MODELS_PATH, self.models, methods=["GET"]),
                Route(MODELS_PATH + "/{model:path}", self.model, methods=["GET"]),
                Route(CHAT_PATH, self.chat, methods=["POST"]),
                Route(COMPLETIONS_PATH, self.completions, methods=["POST"])]

    def abort_all(self) -> None:
        """Cancel every HTTP request in flight (a forced shutdown)."""
        for run in list(self.runs):
            run.abort()

    def _count(self, route: str, status: int) -> None:
        metrics = self.engine.metrics
        if metrics is not None:
            metrics.http_request(route, status)

    def _guard(self, request: Request) -> None:
        refused = refusal(self.access, request.headers, request.url.query, request.url.path)
        if refused is not None:
            status, message = refused
            raise OpenAIError(status, message, code="invalid_api_key" if status == 401 else
                              "origin_not_allowed")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.engine.model_name, "object": "model", "created": self.created,
                "owned_by": "conveyor", "max_model_len": self.engine.max_model_len}

    async def models(self, request: Request) -> Response:
        try:
            self._guard(request)
        except OpenAIError as e:
            self._count(MODELS_PATH, e.status)
            return self._error(e)
        self._count(MODELS_PATH, 200)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """The served model's card; another name: 404 `model_not_found`."""
        route = MODELS_PATH + "/{model}"
        try:
            self._guard(request)
            check_model_name(request.path_params["model"], self.engine.model_name)
        except OpenAIError as e:
            self._count(route, e.status)
            return self._error(e)
        self._count(route, 200)
        return JSONResponse(self._model_card())

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT_PATH, chat_plan, "chatcmpl")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, COMPLETIONS_PATH, completion_plan, "cmpl")

    def _error(self, e: OpenAIError) -> Response:
        response = e.response()
        if e.status == 401:
            response.headers.update(WWW_AUTHENTICATE)
        return response

    async def _body(self, request: Request) -> Any:
        """The request's JSON body. Raises OpenAIError: 415 without `Content-Type:
        application/json`, 413 over `max_message_bytes`, 400 not JSON or nested deeper
        than msgspec decodes (`read_json_body`)."""
        return await read_json_body(request, self.config.max_message_bytes)

    async def _serve(self, request: Request, route: str,
                     make_plan: Callable[[Any, str], Plan], kind_id: str) -> Response:
        run: Run | None = None
        run_id = new_run_id(kind_id)
        try:
            self._guard(request)
            plan = make_plan(await self._body(request), self.engine.model_name)
            run = Run(self.engine, plan, kind_id, run_id)
            self.runs.add(run)
            await run.start()
        except OpenAIError as e:
            if run is not None:
                self.runs.discard(run)
            self._count(route, e.status)
            log_refusal(route, e, run_id)
            return self._error(e)
        watcher = asyncio.get_running_loop().create_task(run.watch(request.receive))
        if plan.stream:
            self._count(route, 200)
            return StreamingResponse(self._streamed(run, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        try:
            body = await run.body()
        except OpenAIError as e:
            self._count(route, e.status)
            log_refusal(route, e, run.id)
            return self._error(e)
        finally:
            watcher.cancel()
            self.runs.discard(run)
        self._count(route, 200)
        return JSONResponse(body)

    async def _streamed(self, run: Run, watcher: asyncio.Task[None]):
        try:
            async for chunk in run.sse():
                yield chunk
        finally:
            watcher.cancel()
            self.runs.discard(run)
