"""A connection's bounded-latency outbox: the engine never waits for a socket.

Events are queued without blocking; one writer task sends them in order. While
the socket is slow, a request's newer delta is merged into its delta that is
still waiting to be sent (text and token ids appended), so a slow reader gets
fewer, larger frames and loses nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque

import msgspec

from protocol import Delta, encode


class Outbox:
    """Pending frames of one connection, merged per request while they wait.

    `pending_bytes` is an estimate of the bytes waiting (text + 8 per token id).
    """

    def __init__(self) -> None:
        self._queue: deque[msgspec.Struct] = deque()
        self._unsent_delta: dict[str, Delta] = {}
        self._ready = asyncio.Event()
        self.pending_bytes = 0

    def put(self, msg: msgspec.Struct) -> None:
        """Queue a frame (never blocks). A Delta merges into an unsent delta of its request."""
        if isinstance(msg, Delta):
            waiting = self._unsent_delta.get(msg.id)
            self.pending_bytes += len(msg.text) + 8 * len(msg.token_ids)
            if waiting is not None:
                waiting.text += msg.text
                waiting.token_ids.extend(msg.token_ids)
                return
            self._unsent_delta[msg.id] = msg
        else:
            req_id = getattr(msg, "id", None)
            if req_id is not None:
                self._unsent_delta.pop(req_id, None)  # later deltas must not jump ahead of it
        self._queue.append(msg)
        self._ready.set()

    async def run(self, send) -> None:
        """Send frames forever with `await send(data: bytes)`; cancel the task to stop."""
        while True:
            while not self._queue:
                self._ready.clear()
                await self._ready.wait()
            msg = self._queue.popleft()
            if isinstance(msg, Delta):
                if self._unsent_delta.get(msg.id) is msg:
                    del self._unsent_delta[msg.id]
                self.pending_bytes -= len(msg.text) + 8 * len(msg.token_ids)
            await send(encode(msg))
