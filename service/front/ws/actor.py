"""What every WebSocket route's actor shares: one socket, its outbox, its life cycle.

`/v1/stream` (service/front/ws/stream.py) and `/v1/responses` (service/front/ws/responses/) speak
different frames over the same mechanisms, which live here once:

- one writer task sends the socket's bounded `Outbox` (a slow reader's deltas merge;
  a reader more than `max_outbox_bytes` behind is closed with 1008 and its requests
  are cancelled);
- closing the socket, cleanly or not, cancels every request of the connection (the
  engine frees their KV blocks before its next step);
- `shutdown()` (graceful drain) sends what is queued, then closes with 1001;
- the `websocket_connections` gauge and the open/close log lines.

A subclass implements `_greet()` (frames sent on open), `_on_frame(frame, received)`
(never raises: a bad frame gets an error frame, the socket stays open), `abort_all()`
and `_pending_tasks()` (admissions to await when the socket closes).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable

import structlog
from service.config import ServerConfig
from service.engine.client import EngineClient
from service.front.ws.outbox import Outbox
from service.front.ws.socket import Socket

log = structlog.get_logger(__name__)
_conn_ids = itertools.count(1)

CLOSE_POLICY_VIOLATION = 1008
CLOSE_GOING_AWAY = 1001


class SocketActor:
    """Serves one socket until it closes; `conn_id` ("c7") names it in logs and request ids."""

    route = "?"

    def __init__(self, ws: Socket, engine: EngineClient, config: ServerConfig) -> None:
        self.ws = ws
        self.engine = engine
        self.config = config
        self.conn_id = f"c{next(_conn_ids)}"
        self.outbox = Outbox(config.max_outbox_bytes, on_overflow=self._on_overflow)
        self._closed = False
        self._closing: asyncio.Task[None] | None = None

    # ---- for subclasses --------------------------------------------------------------
    def _greet(self) -> None:
        """Queue the frames a new connection gets first (none by default)."""

    def _on_frame(self, frame: str | bytes, received: float) -> None:
        raise NotImplementedError

    def abort_all(self) -> None:
        """Cancel every request of this connection (each admitted one still ends)."""
        raise NotImplementedError

    def _pending_tasks(self) -> Iterable[asyncio.Task[None]]:
        """Tasks to await once the socket closed (e.g. admissions in progress)."""
        return ()

    @property
    def num_requests(self) -> int:
        """Requests in flight (for the slow-reader log line)."""
        return 0

    # ---- life cycle ------------------------------------------------------------------
    async def run(self) -> None:
        """Serve frames until the socket closes; then cancel what is left and return."""
        metrics = self.engine.metrics
        if metrics is not None:
            metrics.connections.inc()
        log.info("connection_opened", connection_id=self.conn_id, route=self.route,
                 peer=str(self.ws.remote_address))
        try:
            await self._serve()
        finally:
            if metrics is not None:
                metrics.connections.dec()
            code = self.ws.close_code
            log.info("connection_closed", connection_id=self.conn_id,
                     close_code=1006 if code is None else int(code))

    async def _serve(self) -> None:
        send = lambda data: self.ws.send(data, text=True)  # noqa: E731
        writer = asyncio.create_task(self.outbox.run(send), name=f"{self.conn_id}-writer")
        self._greet()
        try:
            async for frame in self.ws:  # ends when the socket closes (Socket never raises)
                if self._closing is not None:
                    continue  # being closed: read on only to see the peer's close frame
                self._on_frame(frame, time.monotonic())
        finally:
            self._closed = True
            self.abort_all()
            self.outbox.close()
            writer.cancel()
            tasks = [writer, *self._pending_tasks()]
            if self._closing is not None:
                tasks.append(self._closing)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self, code: int, reason: str) -> None:
        """Close the socket with `code`; drop the TCP connection if the peer does not finish
        the closing handshake within `close_timeout` seconds (e.g. it stopped reading)."""
        try:
            await asyncio.wait_for(self.ws.close(code, reason), self.config.close_timeout)
        except TimeoutError:
            log.warning("close_timed_out", connection_id=self.conn_id, close_code=code)
            self.ws.transport.abort()

    async def shutdown(self) -> None:
        """Graceful end: send what is queued (within `close_timeout`), then close with 1001."""
        if not await self.outbox.drain(self.config.close_timeout):
            log.warning("outbox_not_drained", connection_id=self.conn_id,
                        pending_bytes=self.outbox.pending_bytes)
        await self.close(CLOSE_GOING_AWAY, "server shutting down")

    def _on_overflow(self) -> None:
        """The reader fell too far behind (called inside an engine sink: must not block)."""
        log.warning("slow_reader_disconnected", connection_id=self.conn_id,
                    max_outbox_bytes=self.config.max_outbox_bytes,
                    requests_cancelled=self.num_requests)
        self.abort_all()
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(
                self.close(CLOSE_POLICY_VIOLATION,
                           f"too slow: more than {self.config.max_outbox_bytes} bytes unread"),
                name=f"{self.conn_id}-close")
