"""The JSON body of an HTTP route: media type, size, decoding, depth; refusal logging.

Shared by the OpenAI routes and `POST /v1/responses`:
- `Content-Type` must be `application/json` (parameters such as `charset` allowed):
  anything else is 415 `unsupported_media_type`, as a JSON API answers a form post;
- a body over `max_message_bytes` is 413 (by its Content-Length, or while it streams in);
- a body that is not JSON is 400 `invalid_json`; one nested deeper than msgspec decodes
  (it raises RecursionError, at about 1,000 levels: a 2 kB body) is 400
  `invalid_json` too, answered like any other 400, so the keep-alive connection stays
  usable (it used to be a plain-text 500 and a reset connection).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from service.front.openai.errors import OpenAIError
from service.front.refusals import log_refused

__all__ = ["read_json_body", "log_refusal"]

JSON_TYPE = "application/json"


def check_media_type(content_type: str | None) -> None:
    """Raises OpenAIError 415 unless `content_type` is application/json."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON_TYPE:
        shown = f"{content_type[:80]!r}" if content_type else "none"
        raise OpenAIError(415, f"the body must be JSON sent with Content-Type: {JSON_TYPE} "
                          f"(got {shown})", code="unsupported_media_type")


def decode_json(data: bytes) -> Any:
    """The decoded body. Raises OpenAIError 400 `invalid_json` (not JSON, or nested too
    deep to decode)."""
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
    """The request's JSON body; OpenAIError 415 / 413 / 400 as the module says."""
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
