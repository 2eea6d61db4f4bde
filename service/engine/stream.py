"""The engine's per-request output channel: events in order, ending with one `done`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

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


def with_prompt_token_ids(sink: Sink, prompt_token_ids: list[int]) -> Sink:
    """`sink` with the prompt's token ids on the request's first Delta (an empty Delta
    before its Done when it has none: EOS sampled first; none after an Error), for a request
    that asked for them (`EngineRequest.return_prompt_token_ids`, vLLM's
    `return_token_ids`). A first Delta that already carries them is passed as it is."""
    first = True

    def wrapped(event: Event) -> None:
        nonlocal first
        if first and isinstance(event, Delta):
            first = False
            if event.prompt_token_ids is None:
                event = msgspec.structs.replace(event, prompt_token_ids=list(prompt_token_ids))
        elif first and isinstance(event, Error):
            first = False
        elif first and isinstance(event, Done):
            first = False
            sink(Delta(id=event.id, index=0, text="", token_ids=[],
                       prompt_token_ids=list(prompt_token_ids)))
        sink(event)

    return wrapped
