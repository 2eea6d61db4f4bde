"""Prometheus metrics with vLLM's meanings under the prefix `conveyor:`.

| conveyor:                          | vllm:                              |
|------------------------------------|------------------------------------|
| num_requests_running               | num_requests_running               |
| num_requests_waiting               | num_requests_waiting               |
| kv_cache_usage_perc                | kv_cache_usage_perc                |
| prefix_cache_queries_total         | prefix_cache_queries_total         |
| prefix_cache_hits_total            | prefix_cache_hits_total            |
| num_preemptions_total              | num_preemptions_total              |
| prompt_tokens_total                | prompt_tokens_total                |
| generation_tokens_total            | generation_tokens_total            |
| request_success_total{finished_reason} | request_success_total{finished_reason} |
| time_to_first_token_seconds        | time_to_first_token_seconds        |
| inter_token_latency_seconds        | inter_token_latency_seconds        |
| e2e_request_latency_seconds        | e2e_request_latency_seconds        |
| request_queue_time_seconds         | request_queue_time_seconds         |
| iteration_tokens_total             | iteration_tokens_total             |
| websocket_connections              | (none: Conveyor's own)             |
| linear_layers{format}              | (none: layers per weight format)   |
| prefix_cache_tier_hits_total{tier} | (none: prefix hits, tier pool/disk) |
| kv_disk_* (with --kv-disk-path)    | (none: the disk KV tier)           |

The disk tier's metrics (`kv_disk_blocks_written_total`, `kv_disk_bytes_written_total`,
`kv_disk_blocks_read_total`, `kv_disk_bytes_read_total`, `kv_disk_writes_dropped_total`,
`kv_disk_writes_skipped_total`, `kv_disk_eviction_saves_total`,
`kv_disk_read_failures_total{reason}`, `kv_disk_evictions_total`, `kv_disk_usage_bytes`,
`kv_disk_enabled`, and the histogram `kv_disk_load_seconds`: one load's read and
verification, from queueing to done) exist only when the engine has one.

Gauges and the prefix-cache and preemption counters are read from the engine's
state when /metrics is scraped (on the event loop, where that state lives), so
they can never drift from it: never negative, never above their bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.core.engine_core import CoreStats

PREFIX = "conveyor:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)



def _families(names: list[str], values: list[str], rows) -> Iterator:
    """One metric family per (name, doc, value, family class) row, with these labels."""
    for name, doc, value, family in rows:
        metric = family(PREFIX + name, doc, labels=names)
        metric.add_metric(values, value)
        yield metric

class _StateCollector:
    def __init__(self, read: Callable[[], CoreStats | None], labels: dict[str, str]) -> None:
        self._read = read
        self._labels = labels

    def collect(self) -> Iterator:
        s = self._read()
        if s is None:
            return
        names, values = list(self._labels), list(self._labels.values())
        yield from _families(names, values, (
            ("num_requests_running", "Requests in the running batch.", s.running, GaugeMetricFamily),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting, GaugeMetricFamily),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1).",
             min(1.0, max(0.0, s.kv_usage)), GaugeMetricFamily),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_queries, CounterMetricFamily),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
             s.prefix_hits, CounterMetricFamily),
            ("num_preemptions", "Preemptions (swap or recompute).", s.preemptions,
             CounterMetricFamily),
        ))
        tiers = CounterMetricFamily(PREFIX + "prefix_cache_tier_hits",
                                    "Prompt tokens served from the prefix cache, by the tier "
                                    "their KV came from (pool, or read back from disk).",
                                    labels=names + ["tier"])
        tiers.add_metric(values + ["pool"], s.prefix_hits - s.prefix_disk_hits)
        tiers.add_metric(values + ["disk"], s.prefix_disk_hits)
        yield tiers


class _DiskCollector:
    """The disk KV tier's counters, read from its stats at scrape time."""

    def __init__(self, tier, labels: dict[str, str]) -> None:
        self._tier = tier
        self._labels = labels

    def collect(self) -> Iterator:
        t, st = self._tier, self._tier.stats
        names, values = list(self._labels), list(self._labels.values())
        yield from _families(names, values, (
            ("kv_disk_blocks_written", "KV blocks written to the disk tier.",
             st.blocks_written, CounterMetricFamily),
            ("kv_disk_bytes_written", "Bytes of KV block files written.", st.bytes_written,
             CounterMetricFamily),
            ("kv_disk_blocks_read", "KV blocks read back from the disk tier and verified.",
             st.blocks_read, CounterMetricFamily),
            ("kv_disk_bytes_read", "Bytes of KV block files read and verified.", st.bytes_read,
             CounterMetricFamily),
            ("kv_disk_writes_dropped", "Blocks not written: the write queue was full.",
             st.writes_dropped, CounterMetricFamily),
            ("kv_disk_writes_skipped", "Block saves skipped: the tier had room only by "
             "evicting the same sequence's earlier blocks (--kv-disk-size).",
             st.writes_skipped, CounterMetricFamily),
            ("kv_disk_eviction_saves", "Blocks queued for writing when the pool evicted "
             "them (their earlier save had been dropped).", st.eviction_saves,
             CounterMetricFamily),
            ("kv_disk_evictions", "Block files evicted (least recently used sequence ends "
             "first, by --kv-disk-size).",
             st.blocks_evicted, CounterMetricFamily),
            ("kv_disk_usage_bytes", "Bytes of block files the tier holds.",
             t.index.total_bytes, GaugeMetricFamily),
            ("kv_disk_enabled", "1 while the disk tier serves, 0 once an I/O error turned it "
             "off.", int(t.enabled), GaugeMetricFamily),
        ))
        failures = CounterMetricFamily(PREFIX + "kv_disk_read_failures",
                                       "Block reads served as misses, by reason (missing, "
                                       "truncated, checksum, fingerprint, ...).",
                                       labels=names + ["reason"])
        for reason, n in sorted(dict(st.read_failures).items()):
            failures.add_metric(values + [reason], n)
        yield failures


class EngineMetrics:
    """The engine's Prometheus metrics, in their own registry.

    Args:
        model_name: the `model_name` label on every metric (as vLLM).
        registry: where to register (default: a fresh CollectorRegistry).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        self._labels = {"model_name": model_name}
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                lab + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "cancelled", "error"):
            self._success.labels(model_name, reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Receipt to done.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Receipt to first step.", lab,
                               buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total",
                                          "Tokens computed per step.", lab,
                                          buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.connections = Gauge(PREFIX + "websocket_connections", "Open WebSocket connections.",
                                 lab, registry=r).labels(model_name)
        self._linear_layers = Gauge(PREFIX + "linear_layers",
                                    "Linear layers of the model by weight format.",
                                    lab + ["format"], registry=r)
        self._http = Counter(PREFIX + "http_requests", "OpenAI HTTP API requests by route and "
                             "HTTP status.", lab + ["route", "status"], registry=r)
        self._state_reader: Callable[[], CoreStats | None] = lambda: None
        r.register(_StateCollector(lambda: self._state_reader(), self._labels))

    def set_linear_layers(self, formats: Mapping[str, int]) -> None:
        """The model's linear layers per weight format (set once, at start-up)."""
        for fmt, n in formats.items():
            self._linear_layers.labels(self._labels["model_name"], fmt).set(n)

    def read_disk_tier_from(self, tier) -> None:
        """Export a disk KV tier's counters (`service.worker.kv_disk_tier.DiskTier`) and
        observe its load latencies in `kv_disk_load_seconds`."""
        lab = ["model_name"]
        load = Histogram(PREFIX + "kv_disk_load_seconds", "One disk tier load: queued to "
                         "read and verified.", lab, buckets=_LATENCY_BUCKETS,
                         registry=self.registry).labels(self._labels["model_name"])
        tier.on_load_seconds = load.observe
        self.registry.register(_DiskCollector(tier, self._labels))

    def read_state_from(self, reader: Callable[[], CoreStats | None]) -> None:
        """Where the scrape-time gauges come from (the engine installs its reader)."""
        self._state_reader = reader

    def request_finished(self, reason: str, prompt_tokens: int, e2e_s: float,
                         queue_s: float | None) -> None:
        self._success.labels(self._labels["model_name"], reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue.observe(queue_s)

    def http_request(self, route: str, status: int) -> None:
        """Count one OpenAI HTTP request (`conveyor:http_requests_total{route, status}`)."""
        self._http.labels(self._labels["model_name"], route, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
