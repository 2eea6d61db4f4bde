"""ClusterConfig: how many engine replicas, their resources, autoscaling and routing.

Pure (no Ray import): `conveyor serve --replicas N` builds one from its flags (defined
here, beside the fields they set), and the Serve application (service.cluster.app)
turns it into deployment options. Names follow
Ray Serve's deployment options where one exists (`num_replicas`, `max_ongoing_requests`,
`min_replicas`, `max_replicas`, `target_ongoing_requests`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ROUTING = ("prefix-affinity", "power-of-two")


def _check(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """Engine replicas on Ray Serve.

    num_replicas: replicas to start (the initial count when autoscaling).
    min_replicas, max_replicas: autoscaling bounds; both None = a fixed num_replicas.
    target_ongoing_requests: autoscaling target of requests in flight per replica.
    num_cpus_per_replica: Ray CPUs reserved per replica (fractions allowed: 0.5 lets
        two replicas share a core's reservation); torch threads = max(1, round(it))
        unless the engine's num_threads says otherwise.
    num_gpus_per_replica: Ray GPUs per replica (0 on CPU machines).
    max_ongoing_requests: requests Ray Serve lets a replica hold at once; None = the
        engine's max_num_seqs + max_waiting_requests + 16 (its own queue decides, and
        the 16 leave room for aborts and metrics calls).
    routing: "prefix-affinity" (service.cluster.affinity) or "power-of-two" (no affinity).
    imbalanced_threshold: requests in flight; beyond this spread, load beats affinity.
    match_rate_threshold: fraction of a prompt's full blocks that must match (0..1].
    routing_stats_period_s: how often Ray Serve collects each replica's routing stats.
    app_name: the Serve application's name; route_prefix: where the proxy mounts it.
    """

    num_replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    max_ongoing_requests: int | None = None
    routing: str = "prefix-affinity"
    imbalanced_threshold: int = 4
    match_rate_threshold: float = 0.5
    routing_stats_period_s: float = 1.0
    app_name: str = "conveyor"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        _check(self.num_replicas >= 1, "num_replicas", ">= 1", self.num_replicas)
        _check((self.min_replicas is None) == (self.max_replicas is None),
               "min_replicas/max_replicas", "both set (autoscaling) or both None",
               (self.min_replicas, self.max_replicas))
        if self.autoscaling:
            low, high = self.min_replicas, self.max_replicas
            assert low is not None and high is not None
            _check(0 <= low <= self.num_replicas <= high,
                   "replica counts", "0 <= min_replicas <= num_replicas <= max_replicas, "
                   "max_replicas >= 1", (self.min_replicas, self.num_replicas, self.max_replicas))
        _check(self.target_ongoing_requests > 0, "target_ongoing_requests", "> 0",
               self.target_ongoing_requests)
        _check(self.num_cpus_per_replica > 0, "num_cpus_per_replica", "> 0 CPUs",
               self.num_cpus_per_replica)
        _check(self.num_gpus_per_replica >= 0, "num_gpus_per_replica", ">= 0 GPUs",
               self.num_gpus_per_replica)
        _check(self.max_ongoing_requests is None or self.max_ongoing_requests >= 1,
               "max_ongoing_requests", ">= 1 or None", self.max_ongoing_requests)
        _check(self.routing in ROUTING, "routing", " or ".join(ROUTING), self.routing)
        _check(self.imbalanced_threshold >= 0, "imbalanced_threshold", ">= 0 requests",
               self.imbalanced_threshold)
        _check(0 < self.match_rate_threshold <= 1, "match_rate_threshold", "in (0, 1]",
               self.match_rate_threshold)
        _check(self.routing_stats_period_s > 0, "routing_stats_period_s", "> 0 seconds",
               self.routing_stats_period_s)
        _check(bool(self.app_name), "app_name", "a non-empty name", self.app_name)
        _check(self.route_prefix.startswith("/"), "route_prefix", "a path starting with /",
               self.route_prefix)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def torch_threads(self) -> int:
        """Torch threads per replica from its CPU reservation."""
        return max(1, round(self.num_cpus_per_replica))


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """`serve --replicas N`: engine replicas on Ray Serve (the `cluster` extra)."""
    g = p.add_argument_group("cluster (Ray Serve; needs the cluster extra)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve with N engine replicas behind one endpoint on Ray Serve "
                        "(prefix-cache-affinity routing); None = one in-process engine")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. ray://head:10001 or head:6379); None = "
                        "a Ray instance already running on this machine, else a new local one")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0, metavar="CPUS",
                   help="Ray CPUs per replica (fractions allowed); torch threads per replica "
                        "= max(1, round(CPUS)) unless --num-threads is given")
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0, metavar="GPUS",
                   help="Ray GPUs per replica")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: fewest replicas (with --max-replicas; --replicas is the "
                        "initial count)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=16.0, metavar="N",
                   help="autoscaling: requests in flight per replica that Ray Serve aims for")
    g.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                   help="requests one replica may hold (Ray Serve queues the rest); None = "
                        "max_num_seqs + max_waiting_requests + 16")
    g.add_argument("--routing", default="prefix-affinity", choices=["prefix-affinity",
                                                                     "power-of-two"],
                   help="replica choice: prefix-cache affinity with power-of-two balancing, "
                        "or power of two choices alone")
    g.add_argument("--imbalanced-threshold", type=int, default=4, metavar="REQUESTS",
                   help="prefix-affinity: when replicas' requests in flight differ by more, "
                        "load decides (power of two), not the cache")
    g.add_argument("--match-rate-threshold", type=float, default=0.5, metavar="FRACTION",
                   help="prefix-affinity: fraction of a prompt's full blocks that must be on "
                        "one replica for affinity to send it there")


def cluster_config(a: argparse.Namespace) -> ClusterConfig:
    """The cluster flags as a ClusterConfig (raises ValueError for bad values)."""
    return ClusterConfig(num_replicas=ClusterConfig.num_replicas if a.replicas is None
                         else a.replicas, min_replicas=a.min_replicas,
                         max_replicas=a.max_replicas,
                         target_ongoing_requests=a.target_ongoing_requests,
                         num_cpus_per_replica=a.num_cpus_per_replica,
                         num_gpus_per_replica=a.num_gpus_per_replica,
                         max_ongoing_requests=a.max_ongoing_requests, routing=a.routing,
                         imbalanced_threshold=a.imbalanced_threshold,
                         match_rate_threshold=a.match_rate_threshold)
