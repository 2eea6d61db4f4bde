"""The asyncio Python client: many concurrent streamed requests on one WebSocket.

    async with await connect("ws://127.0.0.1:8765/v1/stream") as client:
        async for event in client.generate(prompt="Once upon", max_tokens=16):
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)

One reader task receives every frame and routes it by request id into that
request's unbounded queue (the reader never waits on a slow consumer, so one
stream cannot stall the others). Each `Stream` drains its own queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import AsyncGenerator

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from protocol.codec import decode_client_frame, decode_server_frame, encode
from protocol.errors import (
    ClientConnectionClosed,
    DuplicateId,
    ProtocolError,
    Unauthorized,
    error_from_frame,
)
from protocol.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    ChatMessage,
    Delta,
    Done,
    Error,
    Generate,
    Hello,
    Ping,
    Pong,
    SamplingParams,
    ServerMessage,
)

_log = logging.getLogger(__name__)

_PARAM_NAMES = frozenset(SamplingParams.__struct_fields__)


async def connect(url: str, *, api_key: str | None = None, open_timeout: float = 10) -> Client:
    """Open a connection and wait for the server's `hello`.

    Args:
        url: e.g. "ws://127.0.0.1:8765/v1/stream".
        api_key: sent as "Authorization: Bearer <api_key>" when given.
        open_timeout: seconds allowed for the handshake and, again, for `hello`.

    Raises:
        Unauthorized: the server refused the handshake with HTTP 401/403 or
            answered with an `unauthorized` error frame.
        ProtocolError: the server's first frame was another `error`.
        ClientConnectionClosed: the socket closed before `hello`, or the first
            frame was not `hello` of protocol version 1 (closed with 1002).
        TimeoutError: no handshake or no `hello` within `open_timeout`.
        OSError: the server cannot be reached.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        ws = await ws_connect(url, additional_headers=headers, open_timeout=open_timeout)
    except InvalidStatus as exc:
        if exc.response.status_code in (401, 403):
            raise Unauthorized(f"the server refused the API key: {exc}") from exc
        raise
    try:
        first = decode_server_frame(await asyncio.wait_for(ws.recv(decode=False), open_timeout))
    except ConnectionClosed as exc:
        raise _closed_by(exc) from exc
    except (ValueError, RecursionError) as exc:
        await ws.close(1002, "expected hello")
        raise ClientConnectionClosed(f"the first frame is not a server frame: {exc}", close_code=1002)
    except BaseException:
        await ws.close()
        raise
    if isinstance(first, Error):
        await ws.close()
        raise error_from_frame(first)
    if not isinstance(first, Hello) or first.protocol != PROTOCOL_VERSION:
        await ws.close(1002, "expected hello")
        raise ClientConnectionClosed(
            f"expected hello of protocol {PROTOCOL_VERSION}, got {first!r}", close_code=1002
        )
    return Client(ws, first)


class Client:
    """One WebSocket connection carrying any number of concurrent requests.

    Create it with `await connect(...)`. Closing (`close()` or leaving
    `async with`) ends every open stream with `ClientConnectionClosed`; so
    does the server closing the socket.

    Attributes:
        hello: the server's `hello` frame (model name, `max_model_len`).
    """

    def __init__(self, ws: ClientConnection, hello: Hello) -> None:
        self.hello = hello
        self._ws = ws
        self._requests: dict[str, _Request] = {}
        self._pings: dict[float, asyncio.Future[None]] = {}
        self._ids = itertools.count(1)
        self._closed: ClientConnectionClosed | None = None
        self._reader = asyncio.create_task(self._read_frames(), name="conveyor-client-reader")

    def generate(
        self,
        *,
        messages: Iterable[ChatMessage | Mapping[str, str]] | None = None,
        prompt: str | None = None,
        prompt_token_ids: Iterable[int] | None = None,
        id: str | None = None,  # noqa: A002 - the wire name
        **params: object,
    ) -> Stream:
        """Start a request; iterate the returned Stream for its Deltas and its Done.

        Exactly one of `messages`, `prompt`, `prompt_token_ids`. `params` are
        SamplingParams fields (max_tokens=..., temperature=..., stop=[...]).
        The frame is sent when iteration starts. `id` defaults to a fresh id
        unique on this connection.

        Raises:
            TypeError: a keyword that is not a SamplingParams field.
            InvalidRequest: the frame the server would reject as invalid, with
                the same `param` path the server would name.
        """
        unknown = sorted(set(params) - _PARAM_NAMES)
        if unknown:
            raise TypeError(f"unknown sampling parameters {unknown}; known: {sorted(_PARAM_NAMES)}")
        fields: dict[str, object] = {"type": "generate", "id": self._new_id() if id is None else id}
        for name, value in (
            ("messages", messages),
            ("prompt", prompt),
            ("prompt_token_ids", prompt_token_ids),
        ):
            if value is not None:
                fields[name] = list(value) if not isinstance(value, str) else value
        fields["params"] = params
        frame = decode_client_frame(msgspec.json.encode(fields))
        assert isinstance(frame, Generate), frame
        return Stream(self, frame)

    async def cancel(self, request_id: str) -> None:
        """Ask the server to end `request_id`; its stream then ends with a Done "cancelled".

        Raises InvalidRequest for an id that is not 1 to 128 characters,
        ClientConnectionClosed when the socket is closed.
        """
        await self._send(decode_client_frame(encode(Cancel(id=request_id))))

    async def ping(self) -> float:
        """Round-trip time of an application-level ping, in seconds.

        Raises ClientConnectionClosed if the socket closes before the pong.
        """
        t = time.perf_counter()
        while t in self._pings:  # two pings in one clock tick still get distinct keys
            t = math.nextafter(t, math.inf)
        pong = asyncio.get_running_loop().create_future()
        self._pings[t] = pong
        try:
            await self._send(Ping(t=t))
            await pong
        finally:
            self._pings.pop(t, None)
        return time.perf_counter() - t

    async def close(self) -> None:
        """Close the socket and wait for the reader task; idempotent."""
        await self._ws.close()
        await self._reader

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- used by Stream ------------------------------------------------------

    def _open_request(self, request_id: str) -> _Request:
        if self._closed is not None:
            raise _copy(self._closed)
        if request_id in self._requests:
            raise DuplicateId(
                f"request id {request_id!r} is still in flight on this connection",
                param="$.id",
                request_id=request_id,
            )
        request = self._requests[request_id] = _Request()
        return request

    async def _abandon(self, request_id: str) -> None:
        """Stop listening to a request that has not ended, and cancel it on the server."""
        request = self._requests.get(request_id)
        if request is None:  # ended, or the connection closed
            return
        request.abandoned = True
        try:
            await self._send(Cancel(id=request_id))
        except ClientConnectionClosed:
            pass

    async def _send(self, msg: msgspec.Struct) -> None:
        if self._closed is not None:
            raise _copy(self._closed)
        try:
            await self._ws.send(encode(msg), text=True)
        except ConnectionClosed as exc:
            raise _closed_by(exc) from exc

    def _new_id(self) -> str:
        while True:
            request_id = f"c{next(self._ids)}"
            if request_id not in self._requests:
                return request_id

    # --- reader task -----------------------------------------------------------

    async def _read_frames(self) -> None:
        closed = ClientConnectionClosed("the client's reader stopped")
        try:
            while True:
                data = await self._ws.recv(decode=False)
                try:
                    msg = decode_server_frame(data)
                except (ValueError, RecursionError) as exc:
                    closed = ClientConnectionClosed(f"bad frame from the server: {exc}", close_code=1002)
                    await self._ws.close(1002, "bad frame")
                    return
                self._dispatch(msg)
        except ConnectionClosed as exc:
            closed = _closed_by(exc)
        finally:
            self._closed = closed
            for request in self._requests.values():
                request.queue.put_nowait(closed)
            self._requests.clear()
            for pong in self._pings.values():
                if not pong.done():
                    pong.set_exception(closed)

    def _dispatch(self, msg: ServerMessage) -> None:
        if isinstance(msg, Pong):
            pong = self._pings.get(msg.t) if msg.t is not None else None
            if pong is not None and not pong.done():
                pong.set_result(None)
            return
        if isinstance(msg, Hello):
            _log.warning("ignoring a second hello: %r", msg)
            return
        request_id = msg.id
        if request_id is None:  # an error the server could not tie to a request
            _log.warning("server error not tied to a request: %r", msg)
            return
        request = self._requests.get(request_id)
        if request is None:  # abandoned and already ended, or never ours
            return
        if isinstance(msg, Accepted):
            request.accepted = True
        if isinstance(msg, Done) or (isinstance(msg, Error) and not request.accepted):
            del self._requests[request_id]
        if not request.abandoned:
            request.queue.put_nowait(msg)


class Stream:
    """The events of one request: `async for event in stream` yields Deltas, then the Done.

    The `generate` frame is sent on the first iteration. Leaving early sends
    `cancel`: `break` out of `async for ... in client.generate(...)` (the
    stream is dropped, and asyncio closes its generator in the next loop
    iteration), `await stream.aclose()`, `async with stream:`, or the task
    being cancelled. A stream kept in a variable after `break` is still
    open until one of these, or until it is dropped.

    Attributes:
        id: the request id.
        prompt_tokens: the prompt's length from `accepted`; None before it.
        error: the `error` that arrived after `accepted`, if any (the request
            then ends with a Done of finish_reason "error").
        done: the Done, once it arrived.

    Iteration raises:
        ProtocolError subclass: the server answered `error` before `accepted`.
        DuplicateId: the id is already in flight on this client.
        ClientConnectionClosed: the socket closed before the Done.
    """

    def __init__(self, client: Client, frame: Generate) -> None:
        self.id = frame.id
        self._outcome = _Outcome()
        # The generator holds the outcome, not this stream: no reference cycle, so a stream
        # left in the middle (`break` out of `async for`) is freed at once and asyncio's
        # finalizer closes the generator, which sends `cancel`, without waiting for a
        # garbage collection.
        self._events = _events(client, frame, self._outcome)

    @property
    def prompt_tokens(self) -> int | None:
        return self._outcome.prompt_tokens

    @property
    def error(self) -> ProtocolError | None:
        return self._outcome.error

    @property
    def done(self) -> Done | None:
        return self._outcome.done

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta | Done:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Stop iterating; sends `cancel` unless the request already ended. Idempotent."""
        await self._events.aclose()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class _Outcome:
    """What the server has said of one request: a Stream's `prompt_tokens`, `error` and
    `done`, written by its generator."""

    __slots__ = ("done", "error", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens: int | None = None
        self.error: ProtocolError | None = None
        self.done: Done | None = None


async def _events(client: Client, frame: Generate,
                  outcome: _Outcome) -> AsyncGenerator[Delta | Done, None]:
    """A Stream's iteration: sends `frame`, yields its Deltas and Done, sends `cancel` when
    closed before the request ended."""
    request = client._open_request(frame.id)
    ended = False
    try:
        await client._send(frame)
        while True:
            event = await request.queue.get()
            if isinstance(event, ClientConnectionClosed):
                raise _copy(event)
            if isinstance(event, Accepted):
                outcome.prompt_tokens = event.prompt_tokens
            elif isinstance(event, Delta):
                yield event
            elif isinstance(event, Error):
                error = error_from_frame(event)
                if outcome.prompt_tokens is None:
                    ended = True
                    raise error
                outcome.error = error
            elif isinstance(event, Done):
                ended = True
                outcome.done = event
                yield event
                return
    finally:
        if not ended:
            await client._abandon(frame.id)


class _Request:
    """The reader's routing entry for one request in flight."""

    __slots__ = ("abandoned", "accepted", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ServerMessage | ClientConnectionClosed] = asyncio.Queue()
        self.accepted = False
        self.abandoned = False


def _copy(closed: ClientConnectionClosed) -> ClientConnectionClosed:
    """A fresh exception per raise: one instance raised in many tasks would pile up tracebacks."""
    return ClientConnectionClosed(closed.reason, close_code=closed.close_code)


def _closed_by(exc: ConnectionClosed) -> ClientConnectionClosed:
    frame = exc.rcvd or exc.sent
    return ClientConnectionClosed(str(exc), close_code=frame.code if frame else 1006)


__all__ = ["Client", "Stream", "connect"]
