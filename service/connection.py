"""Connection actor: one per WebSocket. Decodes frames, hands requests to the engine,
writes each request's events to the socket through its Outbox.

A bad frame gets an `error` (`invalid_request`) and the socket stays open. Closing
the socket, cleanly or not, cancels every request of the connection.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import structlog

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from protocol import (PROTOCOL_VERSION, Accepted, Cancel, Done, DuplicateId, Generate, Hello,
                      Ping, Pong, ProtocolError, TooManyRequests, decode_client_frame)
from service.config import ServerConfig
from service.engine import Engine
from service.outbox import Outbox
from service.request_stream import Event

log = structlog.get_logger(__name__)
_conn_ids = itertools.count(1)


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
        self.outbox = Outbox()
        self.in_flight: set[str] = set()

    def _key(self, client_id: str) -> str:
        return f"{self.conn_id}/{client_id}"

    async def run(self) -> None:
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
            log.info("connection_closed", connection_id=self.conn_id)

    async def _serve(self) -> None:
        send = lambda data: self.ws.send(data, text=True)  # noqa: E731
        writer = asyncio.create_task(self.outbox.run(send), name=f"{self.conn_id}-writer")
        self.outbox.put(Hello(protocol=PROTOCOL_VERSION, model=self.engine.model_name,
                              max_model_len=self.engine.max_model_len))
        try:
            async for frame in self.ws:
                self._on_frame(frame, time.monotonic())
                if writer.done():
                    break
        except ConnectionClosed:
            pass
        finally:
            for client_id in list(self.in_flight):
                self.engine.abort(self._key(client_id))
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    def _on_frame(self, frame: str | bytes, received: float) -> None:
        try:
            msg = decode_client_frame(frame)
            if isinstance(msg, Generate):
                self._generate(msg, received)
            elif isinstance(msg, Cancel):
                if msg.id in self.in_flight:
                    self.engine.abort(self._key(msg.id))
            elif isinstance(msg, Ping):
                self.outbox.put(Pong(t=msg.t))
        except ProtocolError as e:
            self.outbox.put(e.to_frame())
        except Exception:
            log.exception("frame_failed", connection_id=self.conn_id)
            from protocol import InternalError
            self.outbox.put(InternalError("the server failed to handle this frame").to_frame())

    def _generate(self, msg: Generate, received: float) -> None:
        if msg.id in self.in_flight:
            raise DuplicateId(f"request id {msg.id!r} is already in flight on this connection",
                              param="$.id", request_id=msg.id)
        if len(self.in_flight) >= self.config.max_requests_per_connection:
            raise TooManyRequests(
                f"this connection already has {len(self.in_flight)} requests in flight "
                f"(limit {self.config.max_requests_per_connection})", request_id=msg.id)
        client_id = msg.id

        def sink(event: Event) -> None:
            if isinstance(event, Done):
                self.in_flight.discard(client_id)
            self.outbox.put(event)

        n = self.engine.add_request(
            messages=msg.messages, prompt=msg.prompt, prompt_token_ids=msg.prompt_token_ids,
            params=msg.params, request_id=self._key(client_id), client_id=client_id,
            sink=sink, arrival_time=received, connection_id=self.conn_id)
        self.in_flight.add(client_id)
        self.outbox.put(Accepted(id=client_id, prompt_tokens=int(n)))
