"""The cluster's front door: the one front app (service/front/) as a Ray Serve ingress,
with a RemoteEngine behind it instead of an in-process Engine.

Every route is the single process's (`service.front.app`): /v1/stream and /v1/responses
(the same socket actors, limits, close codes), the OpenAI HTTP API, /health (plus
"replicas": the replicas routable now), /metrics (the ingress's metrics and every
replica's, label `replica`) and the chat page, with the same auth and Origin checks.
One difference: while draining, new sockets are closed with 1013 at once.

The app is built when the replica starts (`__serve_build_asgi_app__`, after the
constructor), around this replica's RemoteEngine.
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
from service.front.app import build_app

log = structlog.get_logger(__name__)


@serve.ingress()
class Ingress:
    """Serves the front app over the EngineReplica deployment `engine`.

    Args:
        engine: DeploymentHandle of the EngineReplica deployment.
        server_config: limits and access (the `conveyor serve` network flags; host and
            port are the proxy's, set when Serve starts).
        max_waiting_requests: most prompts tokenized at once here.
    """

    async def __init__(self, engine: Any, server_config: ServerConfig,
                       max_waiting_requests: int = 1024) -> None:
        self.config = server_config
        self._deployment = engine.deployment_name
        info = await engine.info.remote()  # waits until a replica is up
        self.metrics = IngressMetrics(info.model_name, decisions=self._decisions)
        self.engine = RemoteEngine(engine, info, self.metrics, max_waiting_requests)
        self.front = build_app(self.engine, server_config, refuse_while_draining=True)
        log.info("ingress_ready", model=info.model_name, deployment=self._deployment)

    def __serve_build_asgi_app__(self) -> Any:
        return self.front.app

    @property
    def connections(self) -> set[Any]:
        return self.front.sockets.connections

    # ---- drain (called by `conveyor serve --replicas` on SIGTERM / SIGINT) -------------
    async def drain(self, timeout: float | None = None) -> bool:
        """Graceful end, as FrontServer.shutdown: /health 503 and new requests get
        `shutting_down` at once; requests in flight get `timeout` seconds (default
        shutdown_timeout), then are cancelled (each still gets its done); every socket is
        closed with 1001. Returns True when every request finished on its own."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        self.engine.begin_shutdown()
        log.info("shutdown_started", requests_in_flight=self.engine.num_unfinished,
                 timeout_s=timeout)
        finished = await self.engine.wait_idle(timeout)
        if not finished:
            for conn in list(self.connections):
                conn.abort_all()
            self.front.openai.abort_all()
            await self.engine.wait_idle(self.config.close_timeout)
        await asyncio.gather(*(conn.shutdown() for conn in list(self.connections)),
                             return_exceptions=True)
        log.info("shutdown_finished", all_finished=finished)
        return finished

    async def __del__(self) -> None:
        await self.engine.close()

    def _decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for router in routers_for(self._deployment):
            for reason, n in router.decisions.items():
                total[reason] = total.get(reason, 0) + n
        return total
