"""OpenAI's error body and HTTP statuses for the HTTP API.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": "invalid_value"}}

| status | type | when |
|---|---|---|
| 400 | invalid_request_error | a bad value, an unknown or unsupported field (`param` names it), a prompt over the context (`context_length_exceeded`) |
| 401 | authentication_error | a missing or wrong API key |
| 403 | permission_error | a browser Origin that is not allowed |
| 404 | invalid_request_error | another model than the served one (`model_not_found`), no such route (`not_found`) |
| 405 | invalid_request_error | a method the route does not take (`method_not_allowed`, with Allow) |
| 413 | invalid_request_error | a body over `max_message_bytes` |
| 429 | rate_limit_error | the admission queue is full (`overloaded`), with Retry-After (s) |
| 503 | service_unavailable | shutting down, with Retry-After |
| 500 | server_error | the engine failed |

An engine refusal's status is its error class's (`protocol.errors`: the one status table,
which the Responses route and the WebSocket routes read too); `ERROR_TYPES` gives
OpenAI's `type` for each status.

An error once an SSE stream has begun is its last `data:` chunk (this body), then
`data: [DONE]`.
"""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from protocol import Error, Overloaded, ProtocolError, status_of

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 500: "server_error"}
"""OpenAI's error `type` for each HTTP status (the HTTP API's and the Responses API's)."""
SHUTDOWN_RETRY_AFTER_S = 5


class OpenAIError(Exception):
    """One OpenAI error answer: HTTP `status`, `message`, `param` (the request's field, e.g.
    "messages[0].content") and `code`; `retry_after_s` sets Retry-After."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if 400 <= self.status < 500
                               else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(self.retry_after_s)}
        return JSONResponse(self.body(), self.status, headers=headers)


def bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 naming `param`."""
    return OpenAIError(400, message, param=param, code=code)


def param_of(path: str | None, renames: dict[str, str]) -> str | None:
    """The wire's JSON path -> the OpenAI request's field: "$.params.top_p" -> "top_p",
    "$.messages[2].role" -> "messages[2].role"; `renames` maps our params back to the
    field the client sent (max_tokens -> max_completion_tokens; a rename that starts with
    "=" names the client's field whole, whatever part of ours is blamed: guided_json ->
    response_format.json_schema.schema is blamed as "guided_json")."""
    if path is None:
        return None
    p = path.removeprefix("$.").removeprefix("params.").replace("[...]", "")  # a dict's value
    head, sep, tail = p.partition(".")
    base = head.split("[")[0]
    if base in renames and renames[base].startswith("="):
        return renames[base][1:]
    if base in renames:
        head = renames[base] + head[len(base):]
    p = head + sep + tail
    return {"prompt_token_ids": "prompt"}.get(p, p.replace("prompt_token_ids", "prompt"))


def from_protocol(e: ProtocolError | Error, renames: dict[str, str],
                  prompt_field: str | None = None) -> OpenAIError:
    """The OpenAI error for an engine refusal (a ProtocolError or an `error` event).
    prompt_field: the request's prompt field ("messages", "prompt"), named as `param` when
    the prompt alone is over the context (OpenAI's own param there) rather than max_tokens."""
    status = status_of(e.code)
    retry = None
    if isinstance(e, Overloaded) or e.code in ("overloaded", "too_many_requests"):
        ms = getattr(e, "retry_after_ms", None) or 1000
        retry = max(1, math.ceil(ms / 1000))
    elif e.code == "shutting_down":
        retry = SHUTDOWN_RETRY_AFTER_S
    param = param_of(e.param, renames)
    if prompt_field is not None and getattr(e, "prompt_alone", False):
        param = prompt_field
    message = e.message
    if e.code == "invalid_request":
        code = "invalid_value"  # as this front's own checks (`bad`) say it
        if e.param and message.startswith(f"{e.param}: "):
            # the engine names the wire's path ("$.params.temperature: ..."): the client
            # named the field as `param` says
            message = f"{param}: {message[len(e.param) + 2:]}" if param else message
    else:
        code = None if e.code == "internal_error" else e.code
    return OpenAIError(status, message, param=param, code=code, retry_after_s=retry)
