"""The `/v1/stream` connection actor (PROTOCOL.md): one per WebSocket. Decodes frames,
hands requests to the engine, writes each request's events to the socket through its
bounded Outbox.

A bad frame gets an `error` (`invalid_request`) and the socket stays open. Closing
the socket, cleanly or not (no close frame, a reset, a keepalive timeout), cancels
every request of the connection at once: the engine frees their KV blocks before
its next step. A reader that falls more than `max_outbox_bytes` behind is closed
with 1008 (policy violation) and its requests are cancelled the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from protocol import (DEFAULT_MAX_TOKENS, PROTOCOL_VERSION, Accepted, Cancel, Done, DuplicateId, Generate, Hello,
                      InternalError, InvalidRequest, Ping, Pong, ProtocolError, TooManyRequests,
                      decode_client_frame)
from service.engine.client import EngineRequest
from service.engine.stream import Event
from service.front.refusals import log_refused
from service.front.ws.actor import CLOSE_GOING_AWAY, CLOSE_POLICY_VIOLATION, SocketActor

log = structlog.get_logger(__name__)

__all__ = ["CLOSE_GOING_AWAY", "CLOSE_POLICY_VIOLATION", "Connection"]


class Connection(SocketActor):
    """Serves one `/v1/stream` socket until it closes (life cycle: `SocketActor`).

    Engine request ids are `"c{conn}/{client id}"`, so equal client ids on different
    sockets never collide; events carry the client's own id.
    """

    route = "/v1/stream"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: set[str] = set()  # client ids: being admitted or admitted, no done yet
        self._admitting: dict[str, asyncio.Task[None]] = {}  # client id -> its admission
        self._cancel_after_admission: set[str] = set()

    def _key(self, client_id: str) -> str:
        return f"{self.conn_id}/{client_id}"

    def _greet(self) -> None:
        self.outbox.put(Hello(protocol=PROTOCOL_VERSION, model=self.engine.model_name,
                              max_model_len=self.engine.max_model_len,
                              sampling_defaults=self.engine.sampling_defaults.as_dict()))

    def _pending_tasks(self) -> Iterable[asyncio.Task[None]]:
        return self._admitting.values()

    @property
    def num_requests(self) -> int:
        return len(self.in_flight)

    def abort_all(self) -> None:
        """Cancel every request of this connection (each admitted one still gets its Done;
        one still being tokenized is never queued)."""
        for task in self._admitting.values():
            task.cancel()
        for client_id in list(self.in_flight):
            self.engine.abort(self._key(client_id))

    def _refused(self, e: ProtocolError) -> None:
        log_refused("/v1/stream", e.code, e.request_id, status=e.http_status, param=e.param,
                    message=e.message, connection_id=self.conn_id)

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
            self._refused(e)
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
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(msg.params, name) is not None:  # not in PROTOCOL.md: refused, not dropped
                raise InvalidRequest(f"{name} are not part of this protocol; the OpenAI HTTP "
                                     f"routes (/v1/completions, /v1/chat/completions) serve "
                                     f"them", param=f"$.params.{name}", request_id=msg.id)
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
            n = await self.engine.add_request(EngineRequest(
                messages=msg.messages, prompt=msg.prompt, prompt_token_ids=msg.prompt_token_ids,
                params=msg.params, request_id=self._key(client_id), client_id=client_id,
                arrival_time=received, connection_id=self.conn_id, tools=msg.tools,
                tool_choice=msg.tool_choice, default_max_tokens=DEFAULT_MAX_TOKENS), sink)
        except ProtocolError as e:
            self.in_flight.discard(client_id)
            self._refused(e)
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
