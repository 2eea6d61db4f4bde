"""RemoteEngine: the Engine's request API, served by engine replicas through Ray Serve.

The ingress's front (service/front/, unchanged) talks to this object as it talks to an
in-process `Engine`: both subclass `service.engine.client.EngineClient`
(`add_request(EngineRequest, sink)` -> prompt tokens, `abort(key)`, `model_name`,
`max_model_len`, `kv_cache_tokens`, `tokenizer`, `sampling_defaults`, `metrics`).
Admission's checks run here, with the engine's own `service.engine.admission.Admission`,
before anything is routed:

    params / messages / ids checked, cheap length bound, chat template + tokenizing
    in a thread pool (the engine's PromptTokenizer), prompt + max_tokens within the
    context and the KV cache, full-block hashes (the engine's KVBlockPool)
      -> ReplicaRequest (with the tools, tool_choice and the style they were rendered in;
         a response_format / structured constraint in its params: the replica's engine
         compiles the same grammar and constrains the output as one process does) -> handle.generate (streaming; the router picks the replica)
      <- Admitted (returned as the prompt length) | Error (raised as its ProtocolError)
      <- event batches, pumped into the sink by a task of the request's own

Counting (so that after quiescence the ingress's `cluster_requests_routed_total` equals
each replica's finished requests): a request counts as routed to a replica when that
replica admitted it, and only then. A client that leaves while its request is being
admitted does not cut the admission short: it finishes in the background, and a request
a replica admitted is then cancelled there (its engine finishes it as "cancelled"), so
both sides count it once. `num_unfinished` (the in-flight gauge) includes those.

`abort` reaches the serving replica through a ReplicaPin, so a cancelled request still
ends with the engine's own Done ("cancelled", with its usage). When the replica dies
mid-stream, the stream's Ray error becomes an `internal_error` (retryable: the request
may be sent again as it was) and a Done ("error") made here from what was streamed.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from ray.exceptions import RayActorError

from protocol import (Delta, Done, DuplicateId, Error, InternalError, ShuttingDown, Timings,
                      Usage, error_from_frame)
from protocol.structured import Tool, ToolChoice
from service.cluster.ingress_metrics import IngressMetrics
from service.cluster.messages import Admitted, ReplicaInfo, ReplicaPin, ReplicaRequest
from service.cluster.registry import routers_for
from service.core.block_pool import KVBlockPool
from service.engine.admission import Admission
from service.engine.client import EngineClient, EngineRequest
from service.engine.stream import Sink, with_prompt_token_ids

log = structlog.get_logger(__name__)

ADMIT_ATTEMPTS = 3
"""Sends of one request while its replica dies before admitting it (nothing was queued
or streamed, so another replica may take it)."""
ABORT_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 5.0
RETRY_AFTER_MS = 1000
"""When a client refused for too many prompts being tokenized here should retry."""


def fresh_call(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` outside the caller's Ray Serve request context.

    Handle calls made while serving a request inherit its internal request id (a
    context variable), so all calls from one WebSocket would share one id; Ray Serve's
    router matches a routed replica to its pending call by that id, and calls routed
    at once to different replicas would be mixed up (or never matched). An empty
    context gives each call an id of its own.
    """
    return contextvars.Context().run(method.remote, *args)


class ReplicaFailed(InternalError):
    """The replica serving a request failed (e.g. its process died); the same request
    may succeed on another replica."""

    retryable = True


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


@dataclass
class _Remote:
    """One request between admission and its Done, as the ingress tracks it."""

    key: str
    request_id: str
    client_id: str
    replica_id: str
    prompt_tokens: int
    sink: Sink
    arrival: float
    completion_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    abort_sent: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)


class RemoteEngine(EngineClient):
    """An `service.engine.client.EngineClient` for a deployment of EngineReplica (see
    the module docstring).

    Args:
        handle: DeploymentHandle of the EngineReplica deployment.
        info: a replica's ReplicaInfo (model, context, tokenizer, block size).
        metrics: the ingress's IngressMetrics.
        max_waiting_requests: most prompts being tokenized at once (`overloaded` beyond).
        expected_replicas: replicas the deployment starts with; `health` says "starting"
            until that many were routable once (then serving while any is).
    """

    def __init__(self, handle: Any, info: ReplicaInfo, metrics: IngressMetrics,
                 max_waiting_requests: int = 1024, expected_replicas: int = 1) -> None:
        self._handle = handle
        self.expected_replicas = max(1, expected_replicas)
        self._started = False  # every expected replica was routable once
        self._stream_handle = handle.options(stream=True)
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.kv_cache_tokens = info.num_kv_blocks * info.block_size  # one replica's
        self.tokenizer = info.tokenizer
        self.sampling_defaults = info.sampling_defaults
        self.metrics = metrics
        # The engine's own admission checks and tokenizing (thread pool), for its model.
        self._admission = Admission(
            info.tokenizer, info.vocab_size, info.max_model_len, info.num_kv_blocks,
            info.block_size, info.sampling_defaults, max_pending=max_waiting_requests,
            retry_after_ms=lambda: RETRY_AFTER_MS)
        # A one-block pool, only for its block_hashes: the engine's own chained hash.
        self._hasher = KVBlockPool(1, info.block_size)
        self._instance = uuid.uuid4().hex[:8]  # engine keys unique across ingresses
        self._live: dict[str, _Remote] = {}
        self._admitting: set[str] = set()
        self._settling: set[asyncio.Future] = set()  # admissions whose caller left
        self._tasks: set[asyncio.Task] = set()
        self.ready = True
        self.accepting = True

    @property
    def num_unfinished(self) -> int:
        """Requests this ingress holds: being admitted (their caller there or gone) or
        streaming."""
        return len(self._live) + len(self._admitting) + len(self._settling)

    # ---- health and metrics (EngineClient) -----------------------------------------------
    def replica_ids(self) -> list[str]:
        """The replicas the deployment's routers can send to now."""
        ids: list[str] = []
        for router in routers_for(getattr(self._handle, "deployment_name", "")):
            ids += [rid for rid in router.replica_ids() if rid not in ids]
        return ids

    def health(self) -> tuple[bool, str]:
        """(serving, why): serving while accepting and some replica is routable, once
        start-up is over (every expected replica routable once; until then why is
        "starting: k of N engine replicas ready")."""
        if not self.accepting:
            return False, "draining"
        n = len(self.replica_ids())
        if not self._started and n < self.expected_replicas:
            return False, f"starting: {n} of {self.expected_replicas} engine replicas ready"
        self._started = True
        return (True, "ok") if n else (False, "no replica is routable")

    def health_info(self) -> dict[str, Any]:
        """Extra /health fields: the replicas routable now, and how many the deployment
        starts with."""
        return {"replicas": len(self.replica_ids()),
                "expected_replicas": self.expected_replicas}

    async def metrics_text(self) -> bytes:
        """The ingress's metrics, then every replica's engine metrics (label `replica`);
        a replica that does not answer within METRICS_TIMEOUT_S is left out."""
        ids = self.replica_ids()
        texts = await asyncio.gather(*(self._replica_metrics(rid) for rid in ids))
        return self.metrics.render({rid: t for rid, t in zip(ids, texts) if t})

    async def _replica_metrics(self, replica_id: str) -> bytes:
        try:
            return await asyncio.wait_for(
                fresh_call(self._handle.metrics_text, ReplicaPin(replica_id)), METRICS_TIMEOUT_S)
        except Exception as e:  # a replica that is going away: its metrics go with it
            log.warning("replica_metrics_failed", replica_id=replica_id, error=type(e).__name__)
            return b""

    async def close(self) -> None:
        """Cancel every stream (each still gets an error and its Done); stop the pool."""
        self.accepting = self.ready = False
        for live in list(self._live.values()):
            if live.task is not None:
                live.task.cancel()
        await asyncio.gather(*self._tasks, *self._settling, return_exceptions=True)
        self._admission.close()

    # ---- admission -------------------------------------------------------------------
    async def add_request(self, request: EngineRequest, sink: Sink) -> int:
        """Validate, tokenize and route one request; as `Engine.add_request` (same
        arguments, same errors, nothing queued when it raises), plus ReplicaFailed
        (retryable internal_error) when no replica could admit it."""
        request = request.resolved()
        key, client_id, arrival = request.request_id, request.client_id, request.arrival_time
        assert key is not None and client_id is not None and arrival is not None
        self._check_accepting(key, client_id)
        self._admitting.add(key)
        try:
            ids, params = await self._admission.prepare(request)
            self._check_accepting(key, client_id, admitting=True)
            routed = ReplicaRequest(
                request_id=f"{self._instance}/{key}", client_id=client_id,
                connection_id=request.connection_id, prompt_token_ids=ids, params=params,
                waited_s=time.monotonic() - arrival,
                block_hashes=tuple(self._hasher.block_hashes(ids)), **self._tools(request))
            send = asyncio.ensure_future(self._send(routed))
            try:
                gen, admitted = await asyncio.shield(send)
            except asyncio.CancelledError:
                self._settle(send)
                raise
        finally:
            self._admitting.discard(key)
        if request.return_prompt_token_ids:
            sink = with_prompt_token_ids(sink, ids)
        live = _Remote(key, routed.request_id, client_id, admitted.replica_id,
                       admitted.prompt_tokens, sink, arrival)
        self._live[key] = live
        self.metrics.routed(admitted.replica_id)
        live.task = asyncio.get_running_loop().create_task(self._pump(live, gen),
                                                           name=f"conveyor-stream-{key}")
        self._tasks.add(live.task)
        live.task.add_done_callback(self._tasks.discard)
        return admitted.prompt_tokens

    def _tools(self, request: EngineRequest) -> dict[str, Any]:
        """The request's tools for its ReplicaRequest (checked by `prepare` already), with
        the style the prompt was rendered in; {} without tools."""
        if request.tools is None and request.tool_choice is None:
            return {}
        tools = msgspec.convert([msgspec.to_builtins(t) for t in request.tools or ()],
                                list[Tool])
        choice = msgspec.convert(msgspec.to_builtins(request.tool_choice), ToolChoice | None)
        return {"tools": tools, "tool_choice": choice,
                "parallel_tool_calls": request.parallel_tool_calls,
                "tool_style": request.tool_style or self._admission.prompts.tool_style}

    def _settle(self, send: asyncio.Future) -> None:
        """The caller left while `send` (an admission) ran: let it finish; a request a
        replica admitted counts as routed there and is cancelled at once (the replica's
        engine then finishes it as "cancelled")."""
        self._settling.add(send)

        def done(task: asyncio.Future) -> None:
            self._settling.discard(task)
            if task.cancelled() or task.exception() is not None:
                return  # refused, or no replica took it: no replica counts it
            gen, admitted = task.result()
            self.metrics.routed(admitted.replica_id)
            gen.cancel()

        send.add_done_callback(done)

    def _check_accepting(self, key: str, client_id: str, admitting: bool = False) -> None:
        if not self.accepting:
            raise ShuttingDown("the server is not accepting requests", request_id=client_id)
        if key in self._live or (not admitting and key in self._admitting):
            raise DuplicateId(f"request id {client_id!r} is already in flight",
                              param="$.id", request_id=client_id)

    async def _send(self, request: ReplicaRequest) -> tuple[Any, Admitted]:
        """Route the request and wait for the replica's admission.

        Raises the replica's ProtocolError when its engine refuses the request, and
        ReplicaFailed when the replicas it was sent to died before admitting it."""
        failure: BaseException | None = None
        for _ in range(ADMIT_ATTEMPTS):
            gen = fresh_call(self._stream_handle.generate, request)
            try:
                first = await gen.__anext__()
            except asyncio.CancelledError:
                gen.cancel()  # the replica aborts it if it was queued already
                raise
            except RayActorError as e:  # died before admitting: nothing queued there
                failure = e
                log.warning("replica_died_before_admission", request_id=request.client_id,
                            error=type(e).__name__)
                continue
            except Exception as e:
                gen.cancel()
                log.exception("admission_failed", request_id=request.client_id)
                raise ReplicaFailed(f"no replica could admit this request: "
                                    f"{type(e).__name__}", request_id=request.client_id) from e
            if isinstance(first, Error):
                raise error_from_frame(first)
            assert isinstance(first, Admitted), f"unexpected first item {first!r}"
            return gen, first
        self.metrics.replica_failures.inc()
        raise ReplicaFailed(f"the replicas this request was sent to died before admitting it "
                            f"({type(failure).__name__})", request_id=request.client_id)

    # ---- streaming ---------------------------------------------------------------------
    async def _pump(self, live: _Remote, gen: Any) -> None:
        """Hand the replica's events to the request's sink until its Done."""
        try:
            async for batch in gen:
                for event in batch:
                    if isinstance(event, Delta):
                        self._count(live, event)
                    live.sink(event)
                    if isinstance(event, Done):
                        return
            raise RuntimeError("the replica's stream ended without a done")
        except asyncio.CancelledError:
            gen.cancel()
            self._fail(live, ReplicaFailed("the server closed before this request finished",
                                           request_id=live.client_id))
        except Exception as e:
            self.metrics.replica_failures.inc()
            log.warning("replica_stream_failed", request_id=live.client_id,
                        replica_id=live.replica_id, error=type(e).__name__,
                        completion_tokens=live.completion_tokens)
            self._fail(live, ReplicaFailed(f"the replica serving this request failed "
                                           f"({type(e).__name__}); it may be sent again",
                                           request_id=live.client_id))
        finally:
            self._live.pop(live.key, None)

    def _count(self, live: _Remote, delta: Delta) -> None:
        now = time.monotonic()
        if live.first_token is None:
            live.first_token = now
        live.last_token = now
        live.completion_tokens += len(delta.token_ids)

    def _fail(self, live: _Remote, error: InternalError) -> None:
        """The request's error frame, then its Done ("error"), from what the ingress saw."""
        end = time.monotonic()
        n = live.completion_tokens
        tpot = None
        if n > 1 and live.first_token is not None and live.last_token is not None:
            tpot = round((live.last_token - live.first_token) * 1000.0 / (n - 1), 3)
        live.sink(error.to_frame())
        live.sink(Done(id=live.client_id, finish_reason="error",
                       usage=Usage(prompt_tokens=live.prompt_tokens, completion_tokens=n,
                                   total_tokens=live.prompt_tokens + n, cached_tokens=0),
                       timings=Timings(ttft_ms=_ms(live.arrival, live.first_token), tpot_ms=tpot,
                                       e2e_ms=_ms(live.arrival, end))))

    # ---- cancel ------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Cancel a request at its replica's next step (its Done says "cancelled");
        unknown ids are ignored."""
        live = self._live.get(request_id)
        if live is None or live.abort_sent:
            return
        live.abort_sent = True
        task = asyncio.get_running_loop().create_task(self._send_abort(live))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_abort(self, live: _Remote) -> None:
        try:
            await asyncio.wait_for(
                fresh_call(self._handle.abort, live.request_id, ReplicaPin(live.replica_id)),
                ABORT_TIMEOUT_S)
        except Exception as e:  # the replica is gone: its stream fails on its own
            log.warning("abort_failed", request_id=live.client_id, replica_id=live.replica_id,
                        error=type(e).__name__)
