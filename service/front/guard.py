"""Who may use a route: the browser Origin and the API key, checked before any route
runs (the rule itself is `service.auth.AccessPolicy`).

Every route but /health is guarded. A WebSocket is refused before its upgrade (HTTP 403 /
401); an OpenAI HTTP route answers OpenAI's error body (`service.front.openai.errors`).
"""

from __future__ import annotations

import http
from collections.abc import Mapping

import structlog

from service.auth import AccessPolicy

log = structlog.get_logger(__name__)

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
