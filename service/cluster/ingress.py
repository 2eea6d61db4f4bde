"""The cluster's front door: the one front app (service/front/) as a Ray Serve ingress,
with a RemoteEngine behind it instead of an in-process Engine.

Every route is the single process's (`service.front.app`): /v1/stream and /v1/responses
(the same socket actors, limits, close codes), the OpenAI HTTP API, /health (plus
"replicas": the replicas routable now, and "expected_replicas"), /metrics (the ingress's
metrics and every replica's, label `replica`) and the chat page, with the same auth and
Origin checks. One difference: while draining, new sockets are closed with 1013 at once.

Start-up: the ingress is up within its actor's start, before any replica has loaded the
model (its constructor does not wait for them), so /health answers at once from the first
moment the proxy routes to it. Until the first replica's facts arrive, `StartingApp`
(service/front/starting.py) answers: /health 503 {"status": "starting", "reason": ...},
sockets closed with 1013 ("the model is loading; try again later"), the HTTP API 503 with
Retry-After. Then the front app serves, and its /health stays 503 "starting: k of N
engine replicas ready" until every replica of the deployment (`expected_replicas`) was
ready once (RemoteEngine.health).

The ASGI app Serve runs (`__serve_build_asgi_app__`, built after the constructor) is that
StartingApp: it hands every request to the front app once the front app exists.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from ray import serve

from service.cluster.ingress_metrics import IngressMetrics
from service.cluster.registry import routers_for
from service.cluster.remote_engine import RemoteEngine
from service.config import ServerConfig
from service.front.access import AccessPolicy
from service.front.app import Front, build_app
from service.front.starting import StartingApp
from service.gc_heap import freeze_startup_heap

log = structlog.get_logger(__name__)


@serve.ingress()
class Ingress:
    """Serves the front app over the EngineReplica deployment `engine`.

    Args:
        engine: DeploymentHandle of the EngineReplica deployment.
        server_config: limits and access (the `conveyor serve` network flags; host and
            port are the proxy's, set when Serve starts).
        max_waiting_requests: most prompts tokenized at once here.
        expected_replicas: replicas the deployment starts with; /health says 503 until
            that many are ready once (then 200 while any is routable).
    """

    async def __init__(self, engine: Any, server_config: ServerConfig,
                       max_waiting_requests: int = 1024, expected_replicas: int = 1) -> None:
        self.config = server_config
        self._deployment = engine.deployment_name
        self._handle = engine
        self._expected = max(1, expected_replicas)
        self.engine: RemoteEngine | None = None
        self.metrics: IngressMetrics | None = None
        self.front: Front | None = None
        self._start_error: str | None = None
        self._starting = StartingApp(
            AccessPolicy(server_config.api_key, server_config.allowed_origins),
            self._starting_state, lambda: self.front.app if self.front is not None else None)
        self._connecting = asyncio.get_running_loop().create_task(
            self._connect(max_waiting_requests), name="conveyor-ingress-connect")

    async def _connect(self, max_waiting_requests: int) -> None:
        """Wait for the first replica's facts (it has loaded the model), then serve."""
        try:
            info = await self._handle.info.remote()
        except Exception as e:  # the deployment failed to start: /health says why
            self._start_error = f"the engine replicas failed to start: {type(e).__name__}: {e}"
            log.error("ingress_start_failed", error=self._start_error)
            return
        metrics = IngressMetrics(info.model_name, decisions=self._decisions)
        # off the event loop: building the admission (tokenizer, template) takes seconds
        # on a busy machine, and /health must answer meanwhile
        engine = await asyncio.to_thread(RemoteEngine, self._handle, info, metrics,
                                         max_waiting_requests, self._expected)
        metrics.track_in_flight(lambda: engine.num_unfinished)
        front = build_app(engine, self.config, refuse_while_draining=True)
        self.metrics, self.engine, self.front = metrics, engine, front
        freeze_startup_heap("ingress")
        log.info("ingress_ready", model=info.model_name, deployment=self._deployment)

    async def wait_ready(self) -> str | None:
        """Wait until the front app serves (the first replica's facts arrived); returns
        None, or why the replicas failed to start. `conveyor serve --replicas` calls it
        before it prints the URL: Serve says RUNNING once the replicas are up, a moment
        before this ingress has heard from them."""
        await asyncio.shield(self._connecting)
        return self._start_error

    def _starting_state(self) -> tuple[str, bool, dict[str, Any]]:
        """What StartingApp answers now: (reason, failed, replica counts)."""
        replicas = len(self._replica_ids())
        counts = {"replicas": replicas, "expected_replicas": self._expected}
        if self._start_error is not None:
            return self._start_error, True, counts
        return (f"starting: the engine replicas are loading the model "
                f"({replicas} of {self._expected} ready)", False, counts)

    def __serve_build_asgi_app__(self) -> Any:
        return self._starting

    @property
    def connections(self) -> set[Any]:
        return self.front.sockets.connections if self.front is not None else set()

    # ---- drain (called by `conveyor serve --replicas` on SIGTERM / SIGINT) -------------
    async def drain(self, timeout: float | None = None) -> bool:
        """Graceful end, as FrontServer.shutdown: /health 503 and new requests get
        `shutting_down` at once; requests in flight get `timeout` seconds (default
        shutdown_timeout), then are cancelled (each still gets its done); every socket is
        closed with 1001. Returns True when every request finished on its own."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        if self.engine is None or self.front is None:  # still starting: nothing in flight
            self._connecting.cancel()
            return True
        finished = await self.engine.drain(timeout, self.config.close_timeout, None,
                                           self.front.abort_all)
        await asyncio.gather(*(conn.shutdown() for conn in list(self.connections)),
                             return_exceptions=True)
        log.info("shutdown_finished", all_finished=finished)
        return finished

    async def __del__(self) -> None:
        self._connecting.cancel()
        if self.engine is not None:
            await self.engine.close()

    # ---- replicas --------------------------------------------------------------------------
    def _replica_ids(self) -> list[str]:
        ids: list[str] = []
        for router in routers_for(self._deployment):
            ids += [rid for rid in router.replica_ids() if rid not in ids]
        return ids

    def _decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for router in routers_for(self._deployment):
            for reason, n in router.decisions.items():
                total[reason] = total.get(reason, 0) + n
        return total
