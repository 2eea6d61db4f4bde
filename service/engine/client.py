"""EngineClient: what a front end (a socket actor, an HTTP route) needs from an engine.

Two classes subclass it: the in-process `service.engine.Engine`, and the cluster's
`service.cluster.remote_engine.RemoteEngine` (the same requests, routed to engine
replicas on Ray Serve). Every front end is typed against this abstract base class, never
against either engine, so one front app serves one process and the Ray ingress alike:

    front (WebSocket actors, OpenAI HTTP routes, /health, /metrics)
        |  add_request(EngineRequest, sink) / abort / health / metrics_text / drain
        v
    EngineClient  <-- Engine (one process)  |  RemoteEngine (Ray Serve replicas)

Both check requests with the same `service.engine.admission.Admission`, so a request is
refused for the same reason with the same error whichever engine is behind the front.
`tests/service/test_engine_client.py` runs one conformance test against both.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from protocol import ChatMessage, SamplingParams
from service.engine.sampling_defaults import SamplingDefaults
from service.engine.stream import Event, RequestStream, Sink

__all__ = ["ENGINE_CLIENT_MEMBERS", "EngineClient", "EngineRequest", "FrontMetrics"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One request as a front hands it to an engine.

    Exactly one of `messages` (chat turns: `ChatMessage`s or `{"role", "content"}` dicts,
    rendered with the model's chat template), `prompt` (raw text, special tokens parsed)
    or `prompt_token_ids` (ids in [0, vocab_size)).
    params: a `SamplingParams` or a mapping of its fields, checked exactly as the wire
        checks `$.params`; unset values take the engine's `sampling_defaults`.
    request_id: the engine-wide key `abort` takes (default: a fresh uuid).
    client_id: the id written into the request's events (default: request_id).
    arrival_time: `time.monotonic()` of receipt, s (default: when the engine gets it);
        TTFT and E2E latency count from it.
    connection_id: logged with every line about the request ("c7").
    continue_final_message: with `messages`, the output continues the last message (no
        generation prompt; the template cut after that message's content), vLLM's field.
    return_prompt_token_ids: the first Delta carries the prompt's token ids (the engine's
        tokenization; `stream.with_prompt_token_ids`).
    default_max_tokens: the route's own cap on an unset max_tokens where the generation
        config sets no max_new_tokens (PROTOCOL.md's 256 on /v1/stream); None: the room the
        context leaves (vLLM's rule, the OpenAI routes).
    tools: OpenAI's tool list (`protocol.structured.Tool`s or their dicts), with
        `messages` (or with `prompt_token_ids` already rendered with them);
        tool_choice: "none", "auto" (the default with tools), "required" or
        `{"type": "function", "function": {"name": ...}}`. The output is then constrained
        to a call or (auto) a plain answer, and calls come as `Delta.tool_calls`.
    parallel_tool_calls: True: several calls may follow each other; False (the default,
        as llama.cpp's server has it): exactly one call when the model calls (OpenAI's
        `parallel_tool_calls`, which OpenAI defaults to true: one call is a valid answer
        either way, and a small model given room for more may repeat its call until
        max_tokens).
    tool_style: how calls are written ("hermes", "llama", "generic"); None: what the
        model's chat template uses (only a caller that rendered the prompt itself sets it).
    """

    messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    params: SamplingParams | Mapping[str, Any] | None = None
    request_id: str | None = None
    client_id: str | None = None
    arrival_time: float | None = None
    connection_id: str | None = None
    continue_final_message: bool = False
    return_prompt_token_ids: bool = False
    default_max_tokens: int | None = None
    tools: Sequence[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = False
    tool_style: str | None = None

    def resolved(self) -> EngineRequest:
        """This request with request_id, client_id and arrival_time filled in."""
        if self.request_id is not None and self.client_id is not None \
                and self.arrival_time is not None:
            return self
        key = self.request_id or uuid.uuid4().hex
        arrival = self.arrival_time if self.arrival_time is not None else time.monotonic()
        return dataclasses.replace(self, request_id=key, client_id=self.client_id or key,
                                   arrival_time=arrival)


class _Gauge(Protocol):
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


class FrontMetrics(Protocol):
    """The metrics a front end writes to: open sockets, and requests of its HTTP routes.

    `connections` is the `conveyor:websocket_connections` gauge; `http_request(route,
    status)` counts one OpenAI HTTP request by route ("/v1/chat/completions") and HTTP
    status code (`conveyor:http_requests_total`). The Engine's `EngineMetrics` and the
    cluster ingress's `IngressMetrics` both have them."""

    connections: _Gauge

    def http_request(self, route: str, status: int) -> None: ...


class EngineClient(abc.ABC):
    """An engine as a front end sees it (Engine and RemoteEngine subclass it).

    Facts (read-only once started):
        model_name: the served model's name ("SmolLM2-135M-Instruct").
        max_model_len: context cap, tokens (prompt + completion).
        kv_cache_tokens: tokens the whole KV cache of one engine holds; no request
            spans more.
        tokenizer: the model's transformers tokenizer (chat template included).
        sampling_defaults: what unset temperature / top_p / top_k / min_p / max_tokens
            become.
        metrics: where the front counts sockets and HTTP requests; None before start.
    State:
        accepting: False once draining (new requests get ShuttingDown).
        num_unfinished: requests admitted or being admitted whose Done is not out yet.
    """

    model_name: str
    max_model_len: int
    kv_cache_tokens: int
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    sampling_defaults: SamplingDefaults
    metrics: FrontMetrics | None
    accepting: bool

    @property
    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests admitted or being admitted whose Done has not been sent yet."""

    # ---- requests ----------------------------------------------------------------------
    @abc.abstractmethod
    async def add_request(self, request: EngineRequest, sink: Sink) -> int:
        """Check, tokenize and queue one request; return its prompt length in tokens.

        Every event of the request (Delta..., maybe Error, then one Done) is passed to
        `sink`, never awaited. Raises a `protocol.ProtocolError` (InvalidRequest naming
        the field, ContextLengthExceeded, DuplicateId, Overloaded with retry_after_ms,
        ShuttingDown, InternalError); nothing is queued when it raises."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (it still ends with its Done, "cancelled");
        unknown ids are ignored. Its KV blocks return within a step."""

    async def open_stream(self, request: EngineRequest) -> RequestStream:
        """`add_request` with a RequestStream as its sink: the stream to iterate (its
        `prompt_tokens` set). Raises what add_request raises."""
        request = request.resolved()
        assert request.client_id is not None
        stream = RequestStream(request.client_id, 0)
        stream.prompt_tokens = await self.add_request(request, stream.put)
        return stream

    async def generate(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
                       prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                       params: SamplingParams | Mapping[str, Any] | None = None,
                       request_id: str | None = None, tools: Sequence[Any] | None = None,
                       tool_choice: Any = None) -> AsyncIterator[Event]:
        """Deltas of one request, then its Done (usage and timings); the fields are
        `EngineRequest`'s. Breaking out of the iteration aborts the request. Raises what
        add_request raises."""
        request = EngineRequest(messages=messages, prompt=prompt,
                                prompt_token_ids=prompt_token_ids, params=params,
                                request_id=request_id, tools=tools,
                                tool_choice=tool_choice).resolved()
        stream = await self.open_stream(request)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.finished:
                assert request.request_id is not None
                self.abort(request.request_id)

    # ---- health and metrics --------------------------------------------------------------
    @abc.abstractmethod
    def health(self) -> tuple[bool, str]:
        """(serving, why): what /health answers (200 when True, else 503 with `why`)."""

    def health_info(self) -> dict[str, Any]:
        """Extra fields of the /health body ({} in one process; {"replicas": N} on Ray)."""
        return {}

    @abc.abstractmethod
    async def metrics_text(self) -> bytes:
        """The Prometheus text /metrics serves (the engine's, or every replica's)."""

    # ---- shutdown ------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Stop accepting (new requests get ShuttingDown); requests in flight go on."""
        self.accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False when `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.num_unfinished:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def drain(self, timeout: float, close_timeout: float,
                    force: asyncio.Event | None, abort_all: Callable[[], None]) -> bool:
        """Graceful drain: stop admitting (`shutting_down`, /health 503), let requests in
        flight finish for `timeout` seconds or until `force` is set, then `abort_all()`
        (the front cancels its requests: each still gets its Done, "cancelled") and wait
        up to `close_timeout` s for them to go. True when every request finished on its own."""
        self.begin_shutdown()
        log.info("shutdown_started", requests_in_flight=self.num_unfinished, timeout_s=timeout)
        waits = [asyncio.ensure_future(self.wait_idle(timeout))]
        if force is not None:
            waits.append(asyncio.ensure_future(force.wait()))
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        finished = waits[0] in done and waits[0].result()
        if not finished:
            log.warning("shutdown_cancelling", requests_in_flight=self.num_unfinished)
            abort_all()
            await self.wait_idle(close_timeout)
        return finished

    @abc.abstractmethod
    async def close(self) -> None:
        """Cancel every request (each still gets its Done) and free what the engine holds.
        Idempotent."""


ENGINE_CLIENT_MEMBERS = ("model_name", "max_model_len", "kv_cache_tokens", "tokenizer",
                         "sampling_defaults", "metrics", "accepting", "num_unfinished",
                         "add_request", "abort", "open_stream", "generate", "health",
                         "health_info", "metrics_text", "begin_shutdown", "wait_idle",
                         "drain", "close")
"""Every member of EngineClient (the conformance test checks each on both engines)."""
