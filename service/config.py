"""Frozen server settings, and the engine's (defined in `service.core.config`).

Names follow vLLM's engine arguments where one exists. Every class validates
itself in `__post_init__` and raises `ValueError` naming the field and its
allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.config import (BATCHING_MODES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, CacheConfig,
                                 EngineConfig, GiB, ModelConfig, PolicyOptions, SchedulerConfig,
                                 _bytes, _check, option)


def _origins(text: str) -> tuple[str, ...]:
    """'http://a:1, https://b' -> ('http://a:1', 'https://b')."""
    return tuple(o.strip() for o in text.split(",") if o.strip())

__all__ = ["BATCHING_MODES", "KV_CACHE_DTYPES", "SCHEDULING_POLICIES", "CacheConfig",
           "EngineConfig", "GiB", "ModelConfig", "PolicyOptions", "SchedulerConfig",
           "ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """The WebSocket/HTTP front end: where it listens, its limits and who may use it.

    host, port: where to listen (127.0.0.1 unless told otherwise; port 0 = any free port).
    max_message_bytes: largest accepted frame; bigger ones close the socket with 1009.
    max_connections: open WebSockets; one more is closed right after its handshake with
        1013 ("try again later"), which browsers can read (an HTTP 503 reaches a page's
        WebSocket only as a bare 1006).
    max_requests_per_connection: requests in flight per socket (`too_many_requests`).
    max_outbox_bytes: how far (estimated bytes of unsent frames) a slow reader may fall
        behind before it is closed with 1008 and its requests cancelled.
    write_limit_bytes: high-water mark of a socket's transport write buffer; above it the
        writer waits, so a slow reader's backlog collects (and merges) in its outbox.
    socket_send_buffer_bytes: SO_SNDBUF of each accepted socket; None = the kernel's
        autotuning (Linux lets it grow to tcp_wmem's maximum, 4 MiB, per socket). A token
        stream needs little, and a small buffer makes a slow reader's backlog show up
        sooner in the outbox (merged, and counted against max_outbox_bytes).
    api_key: required from clients of every route but /health (Bearer header or `api_key`
        query parameter); None = open. Never shown by repr().
    allowed_origins: origins (scheme://host[:port]) whose browser pages may connect;
        empty = any. Requests without an Origin header (non-browser clients) pass.
    shutdown_timeout: seconds a graceful shutdown waits for requests in flight before
        cancelling them.
    close_timeout: seconds a socket gets to finish its closing handshake before its TCP
        connection is dropped.
    ping_interval, ping_timeout: WebSocket keepalive, seconds; a peer that vanished
        without a FIN is dropped (and its requests cancelled) after about their sum.
    responses_max_stored, responses_max_stored_tokens: per `/v1/responses` connection,
        the most completed responses, and token ids of their contexts together (4 bytes
        each), kept for `previous_response_id`; the oldest is dropped first.
    responses_http_max_stored, responses_http_max_stored_tokens: the same bounds for the
        one store of `POST /v1/responses` (all its clients together).
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8765, "TCP port (0 = any free port)")
    max_message_bytes: int = option(
        1 << 20, "largest client frame; bigger ones close the socket with 1009",
        metavar="BYTES", parse=_bytes)
    max_connections: int = option(
        1024, "open WebSockets; one more is closed with 1013 (try again later)", metavar="N")
    max_requests_per_connection: int = option(
        64, "requests in flight per socket (`too_many_requests` beyond)", metavar="N")
    max_outbox_bytes: int = option(
        1 << 20, "unsent bytes a slow reader may fall behind before it is closed with 1008 "
        "and its requests cancelled", metavar="BYTES", parse=_bytes)
    write_limit_bytes: int = 1 << 15
    socket_send_buffer_bytes: int | None = None
    api_key: str | None = field(default=None, repr=False, metadata={
        "help": "require this key (Authorization: Bearer KEY, or ?api_key=KEY for browsers) "
                "on every route but /health; None = $CONVEYOR_API_KEY if set (better than "
                "the flag: not visible in `ps`), else no key", "metavar": "KEY"})
    allowed_origins: tuple[str, ...] = option(
        (), "comma list of origins (e.g. http://127.0.0.1:8765) whose browser pages may "
        "connect, others get HTTP 403; empty = any. List the server's own origin to use the "
        "chat page", metavar="ORIGINS", parse=_origins)
    shutdown_timeout: float = option(
        20.0, "on SIGTERM/SIGINT, how long requests in flight may finish before they are "
        "cancelled (a second signal cancels them at once)", metavar="SECONDS")
    close_timeout: float = 5.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    responses_max_stored: int = option(
        64, "/v1/responses: completed responses kept per connection for "
        "previous_response_id (oldest dropped first)", metavar="N")
    responses_max_stored_tokens: int = option(
        1 << 18, "/v1/responses: token ids of the kept responses' contexts, per connection "
        "(4 bytes each)", metavar="TOKENS")
    responses_http_max_stored: int = option(
        1024, "POST /v1/responses: completed responses kept (all clients together) for "
        "previous_response_id (oldest dropped first)", metavar="N")
    responses_http_max_stored_tokens: int = option(
        1 << 22, "POST /v1/responses: token ids of the kept responses' contexts, all "
        "clients together (4 bytes each)", metavar="TOKENS")

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "in [0, 65535]", self.port)
        _check(self.max_message_bytes >= 1024, "max_message_bytes", ">= 1024 bytes",
               self.max_message_bytes)
        _check(self.max_connections >= 1, "max_connections", ">= 1", self.max_connections)
        _check(self.max_requests_per_connection >= 1, "max_requests_per_connection", ">= 1",
               self.max_requests_per_connection)
        _check(self.max_outbox_bytes >= 1024, "max_outbox_bytes", ">= 1024 bytes",
               self.max_outbox_bytes)
        _check(self.write_limit_bytes >= 1024, "write_limit_bytes", ">= 1024 bytes",
               self.write_limit_bytes)
        _check(self.socket_send_buffer_bytes is None or self.socket_send_buffer_bytes >= 1024,
               "socket_send_buffer_bytes", ">= 1024 bytes or None", self.socket_send_buffer_bytes)
        key = self.api_key
        _check(key is None or (0 < len(key) <= 512 and key.isprintable() and " " not in key),
               "api_key", "1 to 512 printable characters without spaces",
               None if key is None else "<hidden>")
        from service.front.access import normalize_origin  # the rule lives beside its use

        for origin in self.allowed_origins:
            normalize_origin(origin)  # raises ValueError naming the bad origin
        _check(self.shutdown_timeout >= 0, "shutdown_timeout", ">= 0 seconds",
               self.shutdown_timeout)
        _check(self.close_timeout > 0, "close_timeout", "> 0 seconds", self.close_timeout)
        _check(self.ping_interval > 0, "ping_interval", "> 0 seconds", self.ping_interval)
        _check(self.ping_timeout > 0, "ping_timeout", "> 0 seconds", self.ping_timeout)
        _check(self.responses_max_stored >= 1, "responses_max_stored", ">= 1 responses",
               self.responses_max_stored)
        _check(self.responses_max_stored_tokens >= 1, "responses_max_stored_tokens",
               ">= 1 tokens", self.responses_max_stored_tokens)
        _check(self.responses_http_max_stored >= 1, "responses_http_max_stored",
               ">= 1 responses", self.responses_http_max_stored)
        _check(self.responses_http_max_stored_tokens >= 1, "responses_http_max_stored_tokens",
               ">= 1 tokens", self.responses_http_max_stored_tokens)
