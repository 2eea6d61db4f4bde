"""The Ray Serve application: EngineReplica deployment + Ingress, from Conveyor's configs.

    build_app(engine_config, server_config, cluster_config) -> serve.Application
    app_builder({"flags": "--replicas 2 --max-num-seqs 16"})  # `serve run` / Serve YAML

`conveyor serve --replicas N` calls build_app (service.cluster.launch); an existing Ray
cluster runs the same application from a Serve config file whose `import_path` is
`service.cluster.app:app_builder` and whose `args.flags` holds `conveyor serve` flags
(service/cluster/serve_config.yaml).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from service.cluster.config import ClusterConfig
from service.cluster.ingress import Ingress
from service.cluster.replica import EngineReplica
from service.cluster.router import PrefixCacheAffinityRouter
from service.config import EngineConfig, ServerConfig

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"


def replica_engine_config(engine: EngineConfig, cluster: ClusterConfig) -> EngineConfig:
    """The engine settings of one replica: torch threads from its CPU reservation unless
    num_threads was set explicitly."""
    if engine.model.num_threads is not None:
        return engine
    model = dataclasses.replace(engine.model, num_threads=cluster.torch_threads)
    return dataclasses.replace(engine, model=model)


def engine_deployment_options(engine: EngineConfig, server: ServerConfig,
                              cluster: ClusterConfig) -> dict[str, Any]:
    """`serve.deployment` options of the EngineReplica deployment."""
    sched = engine.scheduler
    max_ongoing = cluster.max_ongoing_requests or \
        sched.max_num_seqs + sched.max_waiting_requests + 16
    options: dict[str, Any] = dict(
        name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": cluster.num_cpus_per_replica,
                           "num_gpus": cluster.num_gpus_per_replica},
        max_ongoing_requests=max_ongoing,
        graceful_shutdown_timeout_s=server.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter,
            request_router_kwargs={
                "affinity": cluster.routing == "prefix-affinity",
                "imbalanced_threshold": cluster.imbalanced_threshold,
                "match_rate_threshold": cluster.match_rate_threshold},
            request_routing_stats_period_s=cluster.routing_stats_period_s),
    )
    if cluster.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": cluster.min_replicas, "max_replicas": cluster.max_replicas,
            "initial_replicas": cluster.num_replicas,
            "target_ongoing_requests": cluster.target_ongoing_requests}
    else:
        options["num_replicas"] = cluster.num_replicas
    return options


def build_app(engine: EngineConfig, server: ServerConfig,
              cluster: ClusterConfig) -> serve.Application:
    """EngineReplica x N (routed by PrefixCacheAffinityRouter) behind one Ingress."""
    replica = serve.deployment(EngineReplica, **engine_deployment_options(engine, server,
                                                                          cluster))
    ingress = serve.deployment(
        Ingress, name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
        # every open WebSocket is one ongoing request of the ingress
        max_ongoing_requests=server.max_connections + 64,
        graceful_shutdown_timeout_s=server.shutdown_timeout + server.close_timeout)
    return ingress.bind(replica.bind(replica_engine_config(engine, cluster)), server,
                        engine.scheduler.max_waiting_requests, cluster.num_replicas)


def configs_from_argv(argv: list[str]) -> tuple[EngineConfig, ServerConfig, ClusterConfig]:
    """The three configs from `conveyor serve` flags (raises ValueError for bad values,
    SystemExit for flags argparse refuses)."""
    from service.engine_args import build_parser, cluster_config, engine_config, server_config

    a = build_parser().parse_args(["serve", *argv])
    return engine_config(a), server_config(a), cluster_config(a)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: `args["flags"]` is a string of `conveyor serve` flags,
    e.g. "--replicas 2 --max-num-seqs 16" (--host and --port do not apply: the proxy's
    are the Serve config's http_options). Raises ValueError for other keys or bad flags."""
    unknown = set(args) - {"flags"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; put `conveyor serve` "
                         "flags in args.flags, e.g. args: {flags: '--replicas 2'}")
    engine, server, cluster = configs_from_argv(shlex.split(str(args.get("flags", ""))))
    return build_app(engine, server, cluster)
