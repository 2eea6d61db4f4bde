"""The WebSocket routes' shared door: access, the connection limit, then the socket actor.

    /v1/stream     service.front.ws.stream.Connection          (PROTOCOL.md)
    /v1/responses  service.front.ws.responses.ResponsesConnection  (the Responses WebSocket mode)

A refused browser Origin gets HTTP 403 and a missing or wrong key 401, before the
upgrade. Sockets beyond `max_connections` (and, on the Ray ingress, any socket while
draining) are accepted and closed at once with 1013 ("try again later"): a browser page
sees that code, whereas a refused handshake reaches its WebSocket only as 1006.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from starlette.websockets import WebSocket

from protocol import ShuttingDown, TooManyRequests
from service.config import ServerConfig
from service.engine.client import EngineClient
from service.front.access import AccessPolicy, refuse_socket
from service.front.ws.actor import SocketActor
from service.front.ws.socket import AsgiSocket

log = structlog.get_logger(__name__)

CLOSE_TRY_AGAIN_LATER = TooManyRequests.close_code  # 1013, as ShuttingDown's


class SocketRoutes:
    """Serves every WebSocket of one app; `connections` holds the live actors.

    Args:
        engine: the engine behind the sockets.
        config: limits and access.
        refuse_while_draining: close new sockets with 1013 once the engine stops accepting
            (the Ray ingress; one process greets them and refuses their requests).
    """

    def __init__(self, engine: EngineClient, config: ServerConfig, access: AccessPolicy,
                 refuse_while_draining: bool = False) -> None:
        self.engine = engine
        self.config = config
        self.access = access
        self.refuse_while_draining = refuse_while_draining
        self.connections: set[SocketActor] = set()
        self.refused_connections = 0

    async def serve(self, ws: WebSocket, actor: Callable[..., SocketActor]) -> None:
        """Check access, accept, apply the connection limit, run `actor` until the socket
        closes (its requests are cancelled then)."""
        if await refuse_socket(self.access, ws):
            return
        await ws.accept()
        socket = AsgiSocket(ws, self.config.max_message_bytes)
        limit = self.config.max_connections
        draining = self.refuse_while_draining and not self.engine.accepting
        if len(self.connections) >= limit or draining:
            self.refused_connections += 1
            log.warning("connection_refused", limit=limit, draining=draining,
                        peer=str(socket.remote_address))
            await socket.close(ShuttingDown.close_code if draining else CLOSE_TRY_AGAIN_LATER,
                               f"too many connections (limit {limit}) or shutting down; "
                               "try again later")
            return
        conn = actor(socket, self.engine, self.config)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
