"""One log line per refused request, on every route (structlog event `request_refused`).

A refusal is an answer without generation: a 4xx on the HTTP routes (or a 5xx before any
token), an `error` frame that is a request's only answer on the WebSocket routes. Each
gets one line with the route, the error code, the request id (the HTTP run's id, the
WebSocket request's client id, or null where the body never named one), the param and
the HTTP status, so an operator can tie a client's complaint to the server's reason.
"""

from __future__ import annotations

import structlog

__all__ = ["log_refused"]

log = structlog.get_logger("service.front.refusals")


def log_refused(route: str, code: str | None, request_id: str | None, *, status: int,
                param: str | None = None, message: str = "",
                connection_id: str | None = None) -> None:
    """Log one refused request (info level: refusals are the client's doing)."""
    log.info("request_refused", route=route, status=status, code=code,
             request_id=request_id, param=param, connection_id=connection_id,
             message=message[:200])
