"""Who may use a route: the API key and the browser's Origin, checked before any route
runs. Every route but /health is guarded: a WebSocket is refused before its upgrade (HTTP
403 / 401), an OpenAI HTTP route answers OpenAI's error body (`service.front.openai.errors`).

The key comes from `Authorization: Bearer <key>` (programs) or from an `api_key`
query parameter (browsers: the WebSocket API cannot set headers, so the chat page
carries `?api_key=` from its own URL over to the socket URL). It is compared in
constant time (`hmac.compare_digest`) and never logged: `RedactingLogger` scrubs
it from websockets' own debug lines (request line and headers).

Origin checking is the defence against cross-site WebSocket hijacking: a page on
another site can open a socket to this server from a victim's browser (WebSockets
are not bound by the same-origin policy), and the browser always sends that page's
`Origin`. Requests without an Origin header come from non-browser clients and pass.
The server's own origin is not implied: list it to use the chat page (an implied
"Origin matches Host" rule would let a DNS-rebinding page through).
"""

from __future__ import annotations

import hmac
import http
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from protocol import Unauthorized

log = structlog.get_logger(__name__)

_REDACT = re.compile(r"(?i)(api_key=)[^&\s]*|(authorization:?\s*(?:bearer\s+)?)\S+")


def redact(text: str) -> str:
    """`text` with api_key query values and Authorization header values replaced by "***".

    E.g. "GET /v1/stream?api_key=s3cret&x=1" -> "GET /v1/stream?api_key=***&x=1".
    """
    return _REDACT.sub(lambda m: (m.group(1) or m.group(2)) + "***", text)


def normalize_origin(origin: str) -> str:
    """"HTTP://Example.com:8765" -> "http://example.com:8765".

    Raises ValueError unless `origin` is scheme://host[:port] with scheme http or https
    and nothing after the host (no path, query or trailing slash).
    """
    parts = urlsplit(origin.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname \
            or parts.path or parts.query or parts.fragment or parts.username:
        raise ValueError(f"an origin is scheme://host[:port] (http or https, no path), "
                         f"got {origin!r}")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


class AccessPolicy:
    """Who may use the protected routes.

    Args:
        api_key: the shared secret; None lets every client in.
        allowed_origins: origins (scheme://host[:port]) whose pages may connect; empty
            lets every origin in. Raises ValueError for a malformed origin.
    """

    def __init__(self, api_key: str | None = None, allowed_origins: Iterable[str] = ()) -> None:
        self._key = api_key.encode("utf-8") if api_key else None
        self._origins = frozenset(normalize_origin(o) for o in allowed_origins)

    @property
    def requires_key(self) -> bool:
        return self._key is not None

    def origin_allowed(self, origin: str | None) -> bool:
        """True for no Origin header (not a browser), no allow-list, or a listed origin."""
        if origin is None or not self._origins:
            return True
        try:
            return normalize_origin(origin) in self._origins
        except ValueError:
            return False  # "null" (sandboxed frames, file://) and garbage

    def key_ok(self, authorization: str | None, query: str) -> bool:
        """Whether the request carries the key: the Bearer header, else `api_key` in `query`
        (the part of the path after "?"). True when no key is configured."""
        if self._key is None:
            return True
        given: str | None = None
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                given = token.strip()
        if given is None and query:
            values = parse_qs(query, keep_blank_values=True).get("api_key")
            given = values[0] if values else None
        if given is None:
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._key)


class RedactingLogger(logging.LoggerAdapter):
    """A logger for websockets that formats each line and then scrubs keys from it
    (websockets logs the request path and every header at DEBUG level)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        text = str(msg) % args if args else str(msg)
        self.logger.log(level, redact(text), **kwargs)


KEY_HINT = ("missing or wrong API key: send 'Authorization: Bearer <key>' "
            "or add ?api_key=<key> to the URL")


def refusal(access: AccessPolicy, headers: Mapping[str, str], query: str,
            route: str) -> tuple[int, str] | None:
    """(HTTP status, message) when the request may not use `route`, else None.

    headers: the request's headers (case-insensitive lookup, as Starlette's);
    query: the raw query string (`api_key=` is read from it)."""
    origin = headers.get("origin")
    if not access.origin_allowed(origin):
        log.warning("request_refused", status=403, route=route, origin=origin)
        return http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed"
    if not access.key_ok(headers.get("authorization"), query):
        log.warning("request_refused", status=401, route=route)
        return http.HTTPStatus.UNAUTHORIZED, KEY_HINT
    return None


WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="conveyor"'}


async def refuse_socket(access: AccessPolicy, ws: WebSocket) -> bool:
    """Refuse `ws` before its upgrade when it may not connect (HTTP 403 / 401 with a JSON
    body, or close code 1008 where the server cannot answer a WebSocket with HTTP); True
    when it was refused."""
    refused = refusal(access, ws.headers, ws.url.query, ws.url.path)
    if refused is None:
        return False
    status, message = refused
    try:
        await ws.send_denial_response(JSONResponse(
            {"error": message}, status, headers=WWW_AUTHENTICATE if status == 401 else None))
    except RuntimeError:  # a server that cannot answer a WebSocket with HTTP
        await ws.close(Unauthorized.close_code, "refused")
    return True
