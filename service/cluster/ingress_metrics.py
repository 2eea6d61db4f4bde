"""The cluster's /metrics: the ingress's own metrics plus every replica's engine metrics.

Each replica renders its engine's Prometheus text (the single-process names, `conveyor:`
prefix, vLLM's meanings); the ingress parses it and adds a `replica` label (the Ray
Serve replica id), so one scrape of the proxy shows all replicas side by side:

    conveyor:num_requests_running{model_name="SmolLM2-135M-Instruct",
                                  replica="SERVE_REPLICA::conveyor#EngineReplica#ab12"} 3.0

The ingress's own, under the same prefix:
    websocket_connections                    open sockets on this ingress
    cluster_requests_routed_total{replica}   requests admitted by each replica (after
                                             quiescence: each replica's finished
                                             requests, cancelled ones included)
    cluster_requests_in_flight               requests this ingress holds: being
                                             admitted or streaming
    cluster_replica_failures_total           streams lost to a failed replica
    cluster_routing_decisions_total{reason}  router attempts: affinity, least_cached,
                                             power_of_two, pinned
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from service.engine.metrics import PREFIX


class _DecisionCollector:
    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(PREFIX + "cluster_routing_decisions",
                                     "Routing attempts of this ingress's router, by outcome.",
                                     labels=["reason"])
        for reason, n in sorted(self._read().items()):
            family.add_metric([reason], n)
        yield family


class IngressMetrics:
    """The ingress's metrics in their own registry.

    Args:
        model_name: the `model_name` label (as the engine's metrics carry it).
        decisions: returns the router's decision counts at scrape time.
    """

    def __init__(self, model_name: str,
                 decisions: Callable[[], Mapping[str, int]] = dict) -> None:
        self.registry = r = CollectorRegistry()
        self.connections = Gauge(PREFIX + "websocket_connections", "Open WebSocket connections.",
                                 ["model_name"], registry=r).labels(model_name)
        self._model_name = model_name
        self._http = Counter(PREFIX + "http_requests", "OpenAI HTTP API requests by route and "
                             "HTTP status.", ["model_name", "route", "status"], registry=r)
        self._routed = Counter(PREFIX + "cluster_requests_routed",
                               "Requests admitted, by the replica that took them.",
                               ["replica"], registry=r)
        self.replica_failures = Counter(PREFIX + "cluster_replica_failures",
                                        "Request streams lost because their replica failed.",
                                        registry=r)
        self._in_flight = Gauge(PREFIX + "cluster_requests_in_flight",
                                "Requests this ingress holds: being admitted or streaming.",
                                registry=r)
        r.register(_DecisionCollector(decisions))

    def track_in_flight(self, read: Callable[[], int]) -> None:
        """The in-flight gauge reads `read()` at scrape time."""
        self._in_flight.set_function(read)

    def http_request(self, route: str, status: int) -> None:
        """Count one OpenAI HTTP request (`conveyor:http_requests_total{route, status}`)."""
        self._http.labels(self._model_name, route, str(status)).inc()

    def routed(self, replica_id: str) -> None:
        self._routed.labels(replica_id).inc()

    def render(self, replica_texts: Mapping[str, bytes] = {}) -> bytes:
        """Prometheus text: this registry, then each replica's metrics with `replica`."""
        own = {family.name for family in self.registry.collect()}
        return generate_latest(self.registry) + relabel(replica_texts, exclude=own)


def relabel(replica_texts: Mapping[str, bytes], exclude: Iterable[str] = ()) -> bytes:
    """Merge replicas' Prometheus texts into one, adding `replica="<id>"` to every sample.

    Families of the same name are merged (one HELP/TYPE each); families named in
    `exclude` are left out (the ingress reports those itself, e.g. its sockets). Raises
    ValueError for text that is not Prometheus exposition format.
    """
    merged: dict[str, Metric] = {}
    skip = set(exclude)
    for replica, text in replica_texts.items():
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if family.name in skip:
                continue
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation,
                                                   family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
    registry = CollectorRegistry()
    registry.register(_Fixed(merged.values()))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
