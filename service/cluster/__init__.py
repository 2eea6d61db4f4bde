"""Scale out on Ray Serve: N engine replicas behind one WebSocket endpoint.

    conveyor serve --replicas 2            (README, "Scaling out")

    config.py          ClusterConfig: replicas, resources, autoscaling, routing (pure)
    affinity.py        the prefix-cache affinity policy: hash table, balance, power of two (pure)
    router.py          PrefixCacheAffinityRouter: that policy on Ray Serve's RequestRouter API
    messages.py        what ingress and replicas pass each other (ReplicaRequest, Admitted, ...)
    replica.py         EngineReplica: one Engine per replica; streaming generate, abort, stats
    remote_engine.py   RemoteEngine: an EngineClient over the replicas (ingress side)
    ingress.py         the Serve ingress: the one front app (service/front/) over a RemoteEngine
    ingress_metrics.py the ingress's metrics, and the replicas' relabelled with `replica`
    app.py             build_app(...) / app_builder(args): the Serve application
    launch.py          `conveyor serve --replicas N`: Ray up, deploy, serve, drain

Needs the optional extra `cluster` (ray[serve]); importing this package does not import
Ray, so the single-process server never needs it.
"""

from __future__ import annotations

RAY_MIN_VERSION = (2, 60)
INSTALL_HINT = "pip install -e '.[cluster]' (Ray Serve, ray[serve]>=2.60)"


class ClusterUnavailable(RuntimeError):
    """Ray Serve (the `cluster` extra) is not installed, or too old."""


def require_ray() -> None:
    """Raise ClusterUnavailable, with a one-line install hint, unless Ray Serve >= 2.60
    can be imported (the ingress is our own Starlette app: no FastAPI needed)."""
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise ClusterUnavailable(f"--replicas needs the cluster extra ({e.name or e} is "
                                 f"missing): {INSTALL_HINT}") from None
    version = tuple(int(p) for p in ray.__version__.split(".")[:2] if p.isdigit())
    if version < RAY_MIN_VERSION:
        raise ClusterUnavailable(f"--replicas needs ray[serve] >= 2.60, found "
                                 f"{ray.__version__}: {INSTALL_HINT}")
