"""EngineReplica: one `service.Engine` inside a Ray Serve replica (the deployment class).

    ingress --generate(ReplicaRequest)--> EngineReplica --> Engine.add_request(prompt ids)
            <-- Admitted | Error, then lists of Delta / Error / Done ----

`generate` is a streaming method (callers use `handle.options(stream=True)`). It
yields the admission result first, then the request's events in batches: whatever
the engine produced since the last item (one Ray object per batch, not per token,
so a busy replica sends fewer, larger items). If the caller goes away (the ingress
cancels the call, or its process dies and Ray cancels the generator) the request
is aborted and its KV blocks return at the next step.

Ray Serve calls `record_routing_stats` periodically and hands the result to the
routers (KV usage, running, waiting), `check_health` (the step loop must be alive),
and `__del__` on a graceful shutdown (after Serve drained the replica's requests).
The class is plain Python: `service.cluster.app` makes it a deployment with the
resources asked for (`num_cpus`; torch threads = max(1, round(num_cpus))).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog

from protocol import Done, ProtocolError
from service.cluster.messages import Admitted, ReplicaInfo, ReplicaPin, ReplicaRequest
from service.config import EngineConfig
from service.engine.client import EngineRequest
from service.engine.engine import Engine
from service.engine.stream import Event
from service.gc_heap import freeze_startup_heap

log = structlog.get_logger(__name__)


class EngineReplica:
    """One engine per replica, configured like `conveyor serve` (an EngineConfig).

    Raises what Engine.start() raises (a bad model path fails the replica's start-up,
    and Ray Serve reports the deployment as unhealthy).
    """

    async def __init__(self, engine_config: EngineConfig) -> None:
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.engine = await Engine(engine_config).start()
        freeze_startup_heap("engine replica")  # a process of its own, serving until it ends
        log.info("replica_ready", replica_id=self.replica_id, model=self.engine.model_name,
                 num_threads=engine_config.model.num_threads)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Admitted | list[Event]]:
        """Admit one tokenized request and stream its events (see the module docstring).

        A request the engine refuses yields its `Error` frame alone (never raises a
        ProtocolError through Ray).
        """
        ready = asyncio.Event()
        pending: list[Event] = []

        def sink(event: Event) -> None:
            pending.append(event)
            ready.set()

        try:
            n = await self.engine.add_request(EngineRequest(
                prompt_token_ids=request.prompt_token_ids, params=request.params,
                request_id=request.request_id, client_id=request.client_id,
                arrival_time=time.monotonic() - request.waited_s,
                connection_id=request.connection_id, tools=request.tools,
                tool_choice=request.tool_choice,
                parallel_tool_calls=request.parallel_tool_calls,
                tool_style=request.tool_style), sink)
        except ProtocolError as e:
            yield e.to_frame()
            return
        finished = False
        try:
            yield Admitted(prompt_tokens=int(n), replica_id=self.replica_id)
            while not finished:
                await ready.wait()
                ready.clear()
                batch, pending[:] = pending[:], []
                finished = isinstance(batch[-1], Done)
                yield batch
        finally:
            if not finished:  # the caller went away (cancelled, or its process died)
                self.engine.abort(request.request_id)

    async def abort(self, request_id: str, pin: ReplicaPin | None = None) -> None:
        """Cancel a request at the next step; its stream still ends with its Done
        ("cancelled"). Unknown ids are ignored. `pin` routes the call here."""
        self.engine.abort(request_id)

    async def info(self) -> ReplicaInfo:
        """Model facts and the tokenizer, for an ingress to admit requests as we do."""
        engine = self.engine
        return ReplicaInfo(model_name=engine.model_name, max_model_len=engine.max_model_len,
                           vocab_size=engine.runner.vocab_size,
                           block_size=engine.config.cache.block_size,
                           num_kv_blocks=engine.scheduler.pool.num_blocks,
                           tokenizer=engine.tokenizer,
                           sampling_defaults=engine.sampling_defaults)

    async def metrics_text(self, pin: ReplicaPin | None = None) -> bytes:
        """This engine's Prometheus text (`pin` routes the call here)."""
        metrics = self.engine.metrics
        return metrics.render() if metrics is not None else b""

    async def replica_stats(self, pin: ReplicaPin | None = None) -> dict[str, float]:
        """The routing stats, on demand (`pin` routes the call here)."""
        return self.record_routing_stats()

    def record_routing_stats(self) -> dict[str, float]:
        """Called by Ray Serve every `request_routing_stats_period_s`: what the router
        weighs besides queue length. kv_usage: fraction of KV blocks held (0..1);
        running, waiting: requests in the batch / in the admission queue."""
        s = self.engine.stats()
        if s is None:
            return {}
        return {"kv_usage": s.kv_usage, "running": s.running, "waiting": s.waiting}

    async def check_health(self) -> None:
        """Ray Serve's health check: raises when the engine cannot serve (`Engine.health`:
        its step loop died, or one step has stalled past step_timeout_s), so Serve
        replaces this replica. Draining is healthy: Serve drains replicas itself."""
        ok, why = self.engine.health()
        if not ok and why != "draining":
            raise RuntimeError(f"replica {self.replica_id}: {why}")

    async def __del__(self) -> None:
        await self.engine.close()
