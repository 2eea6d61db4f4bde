"""A connection's completed responses, kept so that `previous_response_id` can continue them.

Each entry holds a response's whole context: the conversation as chat turns and the
exact token ids the engine saw (prompt + output), so that the next turn's prompt starts
with those very tokens and their KV blocks hit the prefix cache. Bounded per
connection: at most `max_responses` entries and `max_tokens` token ids together
(4 bytes each, `array("i")`); the oldest completed response is dropped first. A
response created with `store: false` is not kept in the store, only as the
connection's latest response (replaced by the next one), which is how OpenAI's
WebSocket mode continues `store=false` chains from its connection-local cache.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from protocol import ChatMessage

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True)
class StoredResponse:
    """A completed response's context.

    messages: every turn of the conversation so far (input items and assistant outputs),
        without the `instructions` system turn; the last one's content ends the context.
    instructions: the instructions the context was rendered with (None: none).
    token_ids: [T] int32, the prompt + output token ids the engine processed, ending
        right after the last message's content (no end-of-turn token).
    tools_key: how the prompt rendered the tools (`context.tools_key`; None: no tools).
    body: the Response object as served (JSON bytes), for `GET /v1/responses/{id}` of the
        HTTP route (None: not kept, the WebSocket mode).
    """

    id: str
    messages: tuple[ChatMessage, ...]
    instructions: str | None
    token_ids: array
    tools_key: str | None = None
    body: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ResponseStore:
    """Oldest-first bounded map: response id -> StoredResponse, plus the latest response.

    Raises ValueError for limits < 1.
    """

    def __init__(self, max_responses: int, max_tokens: int) -> None:
        if max_responses < 1 or max_tokens < 1:
            raise ValueError(f"max_responses and max_tokens must be >= 1, got "
                             f"{max_responses}, {max_tokens}")
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._latest: StoredResponse | None = None
        self.num_tokens = 0  # token ids held by the store's entries (not `latest`)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None and self._latest is not None and self._latest.id == response_id:
            return self._latest
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response (stored or the latest); False when it is not kept."""
        found = False
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_tokens -= entry.num_tokens
            found = True
        if self._latest is not None and self._latest.id == response_id:
            self._latest = None
            found = True
        return found

    def put(self, entry: StoredResponse, *, store: bool = True) -> None:
        """Keep `entry` as the latest response and, when `store`, in the store, dropping
        the oldest entries until both bounds hold (an entry over `max_tokens` alone is
        kept only as the latest)."""
        self._latest = entry
        if not store or entry.num_tokens > self.max_tokens:
            return
        self._entries[entry.id] = entry
        self.num_tokens += entry.num_tokens
        while len(self._entries) > self.max_responses or self.num_tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.num_tokens -= old.num_tokens
            self.evicted += 1
