"""A connection's bounded outbox: the engine never waits for a socket.

Events are queued without blocking; one writer task sends them in order. While the
socket is slow (its transport buffer above websockets' `write_limit`, so `send`
waits), a request's newer delta is merged into its delta still waiting to be sent
(text, token ids and tool-call pieces appended): a slow reader gets fewer, larger frames and loses
nothing. A reader that falls more than `max_bytes` behind overflows the outbox: it
drops everything queued, refuses further frames, and calls `on_overflow` once (the
connection then closes the socket with 1008 and cancels its requests).

    queue:  [accepted r1] [delta r1 "The cat"] [pong] [delta r2 "Hi"] ...
                              ^ a new delta of r1 is appended here while it waits

Other protocols' text deltas (e.g. the Responses API's `response.output_text.delta`,
service/front/ws/responses/) merge the same way through the `Appendable` protocol, but only
into the last queued frame: their events are numbered in order (`sequence_number`),
so a delta may only grow the frame that is still the newest of its stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from protocol import Delta, encode
from protocol.structured import FunctionCallDelta, ToolCallDelta

DELTA_OVERHEAD_BYTES = 64
"""Estimated JSON bytes of a delta frame besides its text and token ids."""
TOKEN_ID_BYTES = 8
"""Estimated JSON bytes per token id (up to 6 digits and a comma)."""


def _delta_bytes(msg: Delta) -> int:
    n = len(msg.text.encode("utf-8", "surrogatepass")) + TOKEN_ID_BYTES * len(msg.token_ids)
    for piece in msg.tool_calls or ():  # additive under `_merge_tool_calls`
        n += len(piece.function.arguments.encode("utf-8", "surrogatepass")) \
            + len(piece.function.name or "") + len(piece.id or "")
    return n


def _merge_tool_calls(waiting: list[ToolCallDelta] | None,
                      later: list[ToolCallDelta] | None) -> list[ToolCallDelta] | None:
    """`waiting`'s tool-call pieces followed by `later`'s; a piece that continues the last
    waiting piece's call (same `index`, no `id`) is joined to it (its `arguments`
    appended), so the merged frame carries each call's text once, in order."""
    if not later:
        return waiting
    out = list(waiting or ())
    for piece in later:
        last = out[-1] if out else None
        if last is not None and last.index == piece.index and piece.id is None \
                and piece.function.name is None:
            out[-1] = ToolCallDelta(index=last.index, id=last.id, type=last.type,
                                    function=FunctionCallDelta(
                                        name=last.function.name,
                                        arguments=last.function.arguments
                                        + piece.function.arguments))
        else:
            out.append(piece)
    return out


class Appendable(Protocol):
    """A frame (msgspec Struct) that a later frame of the same stream may be merged into
    while both wait: the outbox keeps it unencoded at the tail of its queue."""

    def absorb(self, later: Any) -> bool:
        """Append `later`'s content to this frame and return True, or return False (then
        `later` is queued as a frame of its own)."""
        ...

    def pending_bytes(self) -> int:
        """Estimated encoded size in bytes (it grows with each absorbed frame)."""
        ...


def _appendable(msg: object) -> bool:
    return hasattr(msg, "absorb") and hasattr(msg, "pending_bytes")


class Outbox:
    """Pending frames of one connection, merged per request while they wait.

    Args:
        max_bytes: overflow once `pending_bytes` exceeds this; None = unbounded.
        on_overflow: called once, synchronously, when the outbox overflows.

    `pending_bytes` estimates the bytes not yet handed to the socket: encoded frames
    exactly, deltas as their UTF-8 text + 8 per token id + 64 per queued frame.
    """

    def __init__(self, max_bytes: int | None = None,
                 on_overflow: Callable[[], None] | None = None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self._on_overflow = on_overflow
        self._queue: deque[Any] = deque()  # Delta | Appendable | bytes (encoded frames)
        self._unsent_delta: dict[str, Delta] = {}
        self._ready = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self.pending_bytes = 0
        self.merged_deltas = 0
        self.overflowed = False
        self.closed = False

    def put(self, msg: msgspec.Struct) -> bool:
        """Queue a frame (never blocks). A Delta merges into an unsent delta of its request;
        an `Appendable` frame into the last queued frame if that one absorbs it.

        Returns True when `msg` was queued as a frame of its own, False when it was merged
        into a waiting one or dropped (after `close()` or an overflow, silently).
        """
        if self.closed:
            return False
        if isinstance(msg, Delta):
            size = _delta_bytes(msg)
            waiting = self._unsent_delta.get(msg.id)
            if waiting is not None:
                waiting.text += msg.text
                waiting.token_ids.extend(msg.token_ids)
                if msg.logprobs:
                    waiting.logprobs = (waiting.logprobs or []) + msg.logprobs
                waiting.tool_calls = _merge_tool_calls(waiting.tool_calls, msg.tool_calls)
                self.merged_deltas += 1
                self._grow(size)
                return False
            msg = Delta(id=msg.id, index=msg.index, text=msg.text, token_ids=list(msg.token_ids),
                        logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs,
                        prompt_token_ids=msg.prompt_token_ids,
                        tool_calls=list(msg.tool_calls) if msg.tool_calls else None)
            self._unsent_delta[msg.id] = msg
            self._queue.append(msg)
            self._grow(size + DELTA_OVERHEAD_BYTES)
        elif _appendable(msg):
            tail = self._queue[-1] if self._queue else None
            if tail is not None and _appendable(tail):
                before = tail.pending_bytes()
                if tail.absorb(msg):
                    self.merged_deltas += 1
                    self._grow(tail.pending_bytes() - before)
                    return False
            self._queue.append(msg)
            self._grow(msg.pending_bytes())
        else:
            req_id = getattr(msg, "id", None)
            if req_id is not None:
                self._unsent_delta.pop(req_id, None)  # later deltas must not jump ahead of it
            data = encode(msg)
            self._queue.append(data)
            self._grow(len(data))
        if not self.closed:
            self._empty.clear()
            self._ready.set()
        return True

    def _grow(self, n: int) -> None:
        self.pending_bytes += n
        if self.max_bytes is not None and self.pending_bytes > self.max_bytes:
            self.overflowed = True
            self.close()
            if self._on_overflow is not None:
                self._on_overflow()

    def close(self) -> None:
        """Drop every queued frame and refuse new ones. Idempotent."""
        self.closed = True
        self._queue.clear()
        self._unsent_delta.clear()
        self.pending_bytes = 0
        self._empty.set()
        self._ready.set()  # wake the writer so that it returns

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued frame was handed to the socket; False after `timeout` s."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def run(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send frames in order with `await send(data)` until `close()`; cancel to stop.

        Exceptions of `send` (e.g. websockets' ConnectionClosed) propagate.
        """
        while not self.closed:
            if not self._queue:
                self._empty.set()
                self._ready.clear()
                await self._ready.wait()
                continue
            item = self._queue.popleft()
            if isinstance(item, Delta):
                if self._unsent_delta.get(item.id) is item:
                    del self._unsent_delta[item.id]
                self.pending_bytes -= _delta_bytes(item) + DELTA_OVERHEAD_BYTES
                data = encode(item)
            elif not isinstance(item, bytes):  # an Appendable frame: encoded as it leaves
                self.pending_bytes -= item.pending_bytes()
                data = encode(item)
            else:
                self.pending_bytes -= len(item)
                data = item
            await send(data)
