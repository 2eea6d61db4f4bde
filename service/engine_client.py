"""EngineClient: what a front end (a socket actor, an HTTP route) needs from an engine.

Two classes honour it: the in-process `service.engine.Engine`, and the cluster's
`service.cluster.remote_engine.RemoteEngine` (the same requests, routed to engine
replicas on Ray Serve). Every front end is typed against this Protocol, never against
either class, so one front app serves one process and the Ray ingress alike:

    front (WebSocket actors, OpenAI HTTP routes, /health, /metrics)
        |  add_request / abort / facts / health / metrics_text / drain
        v
    EngineClient  <-- Engine (one process)  |  RemoteEngine (Ray Serve replicas)

Both check requests with the same `service.admission.Preprocessor`, so a request is
refused for the same reason with the same error whichever engine is behind the front.
`tests/service/test_engine_client.py` runs one conformance test against both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from protocol import ChatMessage, SamplingParams
from service.generation_config import SamplingDefaults
from service.request_stream import RequestStream, Sink

__all__ = ["EngineClient", "FrontMetrics", "ENGINE_CLIENT_MEMBERS"]


class _Gauge(Protocol):
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


@runtime_checkable
class FrontMetrics(Protocol):
    """The metrics a front end writes to: open sockets, and requests of its HTTP routes.

    `connections` is the `conveyor:websocket_connections` gauge; `http_requests(route,
    status)` counts one OpenAI HTTP request by route ("/v1/chat/completions") and HTTP
    status code (`conveyor:http_requests_total`)."""

    connections: _Gauge

    def http_request(self, route: str, status: int) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as a front end sees it (Engine and RemoteEngine implement it).

    Facts (read-only once started):
        model_name: the served model's name ("SmolLM2-135M-Instruct").
        max_model_len: context cap, tokens (prompt + completion).
        kv_cache_tokens: tokens the whole KV cache of one engine holds; no request
            spans more.
        tokenizer: the model's transformers tokenizer (chat template included).
        sampling_defaults: what unset temperature / top_p / top_k / min_p become.
        metrics: where the front counts sockets and HTTP requests; None before start.
    State:
        accepting: False once draining (new requests get ShuttingDown).
        num_unfinished: requests admitted or being admitted whose Done is not out yet.
    """

    model_name: str
    max_model_len: int
    kv_cache_tokens: int
    tokenizer: Any
    sampling_defaults: SamplingDefaults
    metrics: Any
    accepting: bool

    @property
    def num_unfinished(self) -> int: ...

    async def add_request(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
                          prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                          params: SamplingParams | Mapping[str, Any] | None = None,
                          request_id: str | None = None, client_id: str | None = None,
                          sink: Sink | None = None, arrival_time: float | None = None,
                          connection_id: str | None = None) -> RequestStream | int:
        """Check, tokenize and queue one request (exactly one of messages / prompt /
        prompt_token_ids). With `sink`, every event (Delta..., maybe Error, then one Done)
        is passed to it, never awaited, and the prompt length in tokens is returned;
        without, a RequestStream to iterate. `request_id` is the engine-wide key that
        `abort` takes; `client_id` the id written into the events.

        Raises a `protocol.ProtocolError` (InvalidRequest naming the field,
        ContextLengthExceeded, DuplicateId, Overloaded with retry_after_ms, ShuttingDown,
        InternalError); nothing is queued when it raises."""
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (it still ends with its Done, "cancelled");
        unknown ids are ignored. Its KV blocks return within a step."""
        ...

    def health(self) -> tuple[bool, str]:
        """(serving, why): what /health answers (200 when True, else 503 with `why`)."""
        ...

    def health_info(self) -> dict[str, Any]:
        """Extra fields of the /health body ({} in one process; {"replicas": N} on Ray)."""
        ...

    async def metrics_text(self) -> bytes:
        """The Prometheus text /metrics serves (the engine's, or every replica's)."""
        ...

    def begin_shutdown(self) -> None:
        """Stop accepting (new requests get ShuttingDown); requests in flight go on."""
        ...

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False when `timeout` seconds passed first."""
        ...


ENGINE_CLIENT_MEMBERS = ("model_name", "max_model_len", "kv_cache_tokens", "tokenizer",
                         "sampling_defaults", "metrics", "accepting", "num_unfinished",
                         "add_request", "abort", "health", "health_info", "metrics_text", "begin_shutdown",
                         "wait_idle")
"""Every member of EngineClient (the conformance test checks each on both engines)."""
