"""Connection actor: one per WebSocket. Decodes frames, hands requests to the engine,
writes each request's events to the socket through its bounded Outbox.

A bad frame gets an `error` (`invalid_request`) and the socket stays open. Closing
the socket, cleanly or not (no close frame, a reset, a keepalive timeout), cancels
every request of the connection at once: the engine frees their KV blocks before
its next step. A reader that falls more than `max_outbox_bytes` behind is closed
with 1008 (policy violation) and its requests are cancelled the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from protocol import (PROTOCOL_VERSION, Accepted, Cancel, Done, DuplicateId, Generate, Hello,
                      InternalError, Ping, Pong, ProtocolError, TooManyRequests,
                      decode_client_frame)
from service.config import ServerConfig
from service.engine import Engine
from service.outbox import Outbox
from service.request_stream import Event

log = structlog.get_logger(__name__)
_conn_ids = itertools.count(1)

CLOSE_POLICY_VIOLATION = 1008
CLOSE_GOING_AWAY = 1001


class Connection:
    """Serves one socket until it closes.

    Engine request ids are `"c{conn}/{client id}"`, so equal client ids on different
    sockets never collide; events carry the client's own id.
    """

    def __init__(self, ws: ServerConnection, engine: Engine, config: ServerConfig) -> None:
        self.ws = ws
        self.engine = engine
        self.config = config
        self.conn_id = f"c{next(_conn_ids)}"
        self.outbox = Outbox(config.max_outbox_bytes, on_overflow=self._on_overflow)
        self.in_flight: set[str] = set()  # client ids: being admitted or admitted, no done yet
        self._admitting: dict[str, asyncio.Task[None]] = {}  # client id -> its admission
        self._cancel_after_admission: set[str] = set()
        self._closed = False
        self._closing: asyncio.Task[None] | None = None

    def _key(self, client_id: str) -> str:
        return f"{self.conn_id}/{client_id}"

    async def run(self) -> None:
        """Serve frames until the socket closes; then cancel what is left and return."""
        metrics = self.engine.metrics
        if metrics is not None:
            metrics.connections.inc()
        log.info("connection_opened", connection_id=self.conn_id,
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
        self.outbox.put(Hello(protocol=PROTOCOL_VERSION, model=self.engine.model_name,
                              max_model_len=self.engine.max_model_len))
        try:
            async for frame in self.ws:
                if self._closing is not None:
                    continue  # being closed: read on only to see the peer's close frame
                self._on_frame(frame, time.monotonic())
        except ConnectionClosed:
            pass
        finally:
            self._closed = True
            self.abort_all()
            self.outbox.close()
            writer.cancel()
            tasks = [writer, *self._admitting.values()]
            if self._closing is not None:
                tasks.append(self._closing)
            await asyncio.gather(*tasks, return_exceptions=True)

    def abort_all(self) -> None:
        """Cancel every request of this connection (each admitted one still gets its Done;
        one still being tokenized is never queued)."""
        for task in self._admitting.values():
            task.cancel()
        for client_id in list(self.in_flight):
            self.engine.abort(self._key(client_id))

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
                    requests_cancelled=len(self.in_flight))
        self.abort_all()
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(
                self.close(CLOSE_POLICY_VIOLATION,
                           f"too slow: more than {self.config.max_outbox_bytes} bytes unread"),
                name=f"{self.conn_id}-close")

    def _on_frame(self, frame: str | bytes, received: float) -> None:
        try:
            msg = decode_client_frame(frame)
            if isinstance(msg, Generate):
                self._generate(msg, received)
            elif isinstance(msg, Cancel):
                if msg.id in self._admitting:
                    self._cancel_after_admission.add(msg.id)
                elif msg.id in self.in_flight:
                    self.engine.abort(self._key(msg.id))
            elif isinstance(msg, Ping):
                self.outbox.put(Pong(t=msg.t))
        except ProtocolError as e:
            self.outbox.put(e.to_frame())
        except Exception:
            log.exception("frame_failed", connection_id=self.conn_id)
            self.outbox.put(InternalError("the server failed to handle this frame").to_frame())

    def _generate(self, msg: Generate, received: float) -> None:
        """Checks that need no engine, then admission in a task of its own: the prompt is
        tokenized off the event loop while this socket's other frames are read on."""
        if msg.id in self.in_flight:
            raise DuplicateId(f"request id {msg.id!r} is already in flight on this connection",
                              param="$.id", request_id=msg.id)
        if len(self.in_flight) >= self.config.max_requests_per_connection:
            raise TooManyRequests(
                f"this connection already has {len(self.in_flight)} requests in flight "
                f"(limit {self.config.max_requests_per_connection})", request_id=msg.id)
        self.in_flight.add(msg.id)  # reserved: a second generate with this id is a duplicate
        self._admitting[msg.id] = asyncio.get_running_loop().create_task(
            self._admit(msg, received), name=f"{self.conn_id}-admit")

    async def _admit(self, msg: Generate, received: float) -> None:
        client_id = msg.id

        def sink(event: Event) -> None:
            if isinstance(event, Done):
                self.in_flight.discard(client_id)
            self.outbox.put(event)

        try:
            n = await self.engine.add_request(
                messages=msg.messages, prompt=msg.prompt, prompt_token_ids=msg.prompt_token_ids,
                params=msg.params, request_id=self._key(client_id), client_id=client_id,
                sink=sink, arrival_time=received, connection_id=self.conn_id)
        except ProtocolError as e:
            self.in_flight.discard(client_id)
            self.outbox.put(e.to_frame())
            return
        except asyncio.CancelledError:
            self.in_flight.discard(client_id)
            raise
        except Exception:
            self.in_flight.discard(client_id)
            log.exception("admission_failed", connection_id=self.conn_id, request_id=client_id)
            self.outbox.put(InternalError("the server failed to admit this request",
                                          request_id=client_id).to_frame())
            return
        finally:
            self._admitting.pop(client_id, None)
        # Queued: nothing of it can be sent before this line (events come from later steps).
        self.outbox.put(Accepted(id=client_id, prompt_tokens=int(n)))
        if self._closed or client_id in self._cancel_after_admission:
            self._cancel_after_admission.discard(client_id)
            self.engine.abort(self._key(client_id))
