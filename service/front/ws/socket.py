"""`Socket`, what the socket actors are typed against, and `AsgiSocket`, the one transport
adapter that gives it: an ASGI (Starlette) WebSocket, as uvicorn (`conveyor serve`) and Ray
Serve's HTTP proxy (the cluster's ingress) both hand it over, so the same actors (and the
same frames, outbox, limits and close codes) serve one process and the cluster:

    async for frame in socket      text (str) or binary (bytes) frames until the peer
                                   closes; a frame over `max_message_bytes` closes the
                                   socket with 1009, as websockets does
    await socket.send(data, text=True)
    await socket.close(code, reason)
    socket.close_code, socket.remote_address, socket.transport.abort()

ASGI has no way to drop a TCP connection. Our own uvicorn protocol
(service/front/ws/uvicorn_protocol.py) puts its transport's abort in the scope's extensions
(`TRANSPORT_ABORT`): `transport.abort()` calls it, so a peer that stopped reading cannot
hold the socket past `close_timeout`, as with websockets' own server. Without it (behind
Ray Serve's proxy) `transport.abort()` only ends the iteration and lets the server close
the socket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

CLOSE_MESSAGE_TOO_BIG = 1009
TRANSPORT_ABORT = "conveyor.transport_abort"
"""Scope extension: () -> None, drops the TCP connection at once."""


class Transport(Protocol):
    def abort(self) -> None: ...


class Socket(Protocol):
    """One accepted WebSocket as the actors use it (see the module docstring). Iterating
    ends when the peer closes or the socket is closed; it never raises for a closed socket."""

    close_code: int | None
    remote_address: tuple[str, int] | None
    transport: Transport

    def __aiter__(self) -> AsyncIterator[str | bytes]: ...

    async def send(self, data: bytes | str, text: bool = True) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


class AsgiSocket:
    """Wraps an accepted Starlette WebSocket (see the module docstring).

    Args:
        ws: the WebSocket, already accepted.
        max_message_bytes: largest frame accepted, in bytes (UTF-8 for text frames).
    """

    def __init__(self, ws: WebSocket, max_message_bytes: int) -> None:
        self._ws = ws
        self._max = max_message_bytes
        self.close_code: int | None = None
        self._closed = False
        client = ws.client
        self.remote_address = (client.host, client.port) if client is not None else None
        self.transport = self  # transport.abort(): drop the TCP connection

    def abort(self) -> None:
        """Drop the connection (where the server lets us; see the module docstring)."""
        self._closed = True
        drop = (self._ws.scope.get("extensions") or {}).get(TRANSPORT_ABORT)
        if drop is not None:
            drop()  # the server's connection_lost ends the iteration

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[str | bytes]:
        while not self._closed:
            try:
                message: dict[str, Any] = await self._ws.receive()
            except (WebSocketDisconnect, RuntimeError):  # closed meanwhile
                self._closed = True
                return
            if message["type"] == "websocket.disconnect":
                self._closed = True
                if self.close_code is None:
                    self.close_code = int(message.get("code") or 1005)
                return
            text, data = message.get("text"), message.get("bytes")
            frame = text if text is not None else data
            if frame is None:
                continue
            size = len(frame) if isinstance(frame, bytes) else \
                len(frame.encode("utf-8", "surrogatepass"))
            if size > self._max:
                await self.close(CLOSE_MESSAGE_TOO_BIG,
                                 f"frame of {size} bytes is over the limit of {self._max}")
                return
            yield frame

    async def send(self, data: bytes | str, text: bool = True) -> None:
        """Send one frame (bytes are UTF-8 JSON: sent as a text frame when `text`)."""
        if text:
            await self._ws.send_text(data.decode("utf-8") if isinstance(data, bytes) else data)
        else:
            await self._ws.send_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close with `code` (idempotent)."""
        if self.close_code is None:
            self.close_code = code
        if self._closed:
            return
        self._closed = True
        try:
            await self._ws.close(code, reason)
        except (RuntimeError, WebSocketDisconnect):  # the peer closed first
            pass
