"""The engine's per-request output channel: events in order, ending with one `done`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from protocol import Delta, Done, Error

Event = Delta | Error | Done
Sink = Callable[[Event], None]


class RequestStream:
    """An async iterator over one request's events: deltas, maybe an error, then its Done.

    The engine puts events without ever waiting (the queue is unbounded: a slow
    consumer makes the queue grow, never the engine stall). `prompt_tokens` is the
    prompt's length in tokens.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    def put(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, Done):
            self.finished = True
        return event
