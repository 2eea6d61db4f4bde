"""A real Ray Serve cluster for the tests of a module: 2 engine replicas + the ingress.

One Ray start per test module (module scope): Ray itself takes ~10 s here and each
replica loads the model (~30-60 s on 2 shared cores, the two in parallel). Ray gets
2 CPUs; each replica reserves 0.5 and runs 1 torch thread. Modules that need it set
`pytestmark = cluster_marks` (marked slow: `scripts/test --all` and CI run them;
skipped, with the install hint, without the extra).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import socket
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import pytest

from service.cluster.config import ClusterConfig
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

HAVE_RAY = importlib.util.find_spec("ray") is not None
cluster_marks = [
    pytest.mark.cluster, pytest.mark.model, pytest.mark.slow,
    pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed: "
                                            "pip install -e '.[cluster]'"),
]

_ROUTED = re.compile(r'^conveyor:cluster_requests_routed_total\{replica="([^"]+)"\} (\S+)$',
                     re.M)


def small_engine_config() -> EngineConfig:
    """Small engines: 512 blocks of 16 tokens, 16 sequences, 256-token steps, 1 thread."""
    return EngineConfig(model=ModelConfig(num_threads=1),
                        cache=CacheConfig(num_kv_blocks=512, swap_space=0.0),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningCluster:
    """The cluster's endpoint and what its /metrics tell."""

    port: int

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    async def aget(self, path: str) -> tuple[int, str]:
        return await asyncio.to_thread(self.get, path)

    async def routed(self) -> Counter[str]:
        """Requests admitted so far, by replica id (the ingress's counter)."""
        status, text = await self.aget("/metrics")
        assert status == 200, text
        return Counter({rid: int(float(n)) for rid, n in _ROUTED.findall(text)})


def start_cluster(cluster: ClusterConfig, engine: EngineConfig | None = None,
                  server: ServerConfig | None = None) -> RunningCluster:
    """Ray (2 CPUs, no dashboard), Serve's proxy on a free port, and the application."""
    import ray
    from ray import serve

    from service.cluster.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(engine or small_engine_config(), server or ServerConfig(port=port),
                        cluster), name=cluster.app_name, blocking=False)
    running = RunningCluster(port)
    # Serve says RUNNING once every replica is up; the ingress says 200 once it has seen
    # them all (its router learns of replicas a moment later)
    deadline = time.monotonic() + 120
    while running.get("/health")[0] != 200:
        assert time.monotonic() < deadline, running.get("/health")
        time.sleep(0.2)
    return running


def stop_cluster() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """2 replicas (0.5 CPU, 1 torch thread each), prefix-affinity routing."""
    if not HAVE_RAY:
        pytest.skip("the cluster extra is not installed: pip install -e '.[cluster]'")
    try:
        yield start_cluster(ClusterConfig(num_replicas=2, num_cpus_per_replica=0.5))
    finally:
        stop_cluster()
