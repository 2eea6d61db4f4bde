"""`conveyor serve --replicas N`: bring Ray up, deploy the application, serve, drain.

    0. The gate (service.cluster.gate) listens on --host:--port before Ray starts, so
       /health answers at once: 503 "starting" with a reason until the Ingress answers,
       then everything is relayed to Serve's proxy.
    1. Ray: join --ray-address, else a Ray instance already running on this machine
       (`ray start --head`), else start a local one (no dashboard: it costs CPU).
    2. Serve's HTTP proxy on 127.0.0.1:<a free port> behind the gate, then the
       application (service.cluster.app): N EngineReplica replicas, each loading the
       model, and the Ingress.
    3. Wait until the ingress has heard from a replica (`Ingress.wait_ready`: a socket
       opened before is closed with 1013), print the URL; serve until SIGTERM / SIGINT.
    4. Drain like `conveyor serve`: /health 503, new requests `shutting_down`, requests
       in flight get --shutdown-timeout seconds (a second signal cancels them at once),
       sockets close with 1001; then the gate stops listening, the application is
       deleted, and Serve and Ray are shut down if this command started them.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.cluster.config import ClusterConfig

GRACE_S = 30.0
"""Seconds beyond --shutdown-timeout allowed for the drain call itself."""


def start_ray(address: str | None) -> bool:
    """Connect to Ray (see the module docstring); True when this call started it."""
    import ray

    if address:
        ray.init(address=address)
        return False
    try:
        ray.init(address="auto")  # a cluster started with `ray start` on this machine
        return False
    except ConnectionError:
        ray.init(address="local", include_dashboard=False)
        return True


def routing_note(c: ClusterConfig) -> str:
    """One line on the router's thresholds, for the start-up log."""
    if c.routing != "prefix-affinity":
        return f"routing {c.routing}: power of two choices by queue length"
    return (f"routing prefix-affinity: balance threshold {c.imbalanced_threshold} requests "
            f"in flight (a wider spread between replicas routes by load), match-rate "
            f"threshold {c.match_rate_threshold:g} (fraction of a prompt's full KV blocks a "
            f"replica must hold to win by affinity)")


def free_local_port() -> int:
    """A free TCP port on 127.0.0.1 (for Serve's proxy behind the gate)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proxy_address(requested: int) -> tuple[str, int]:
    """Where Serve's proxy listens: the options it runs with (a Serve that was already
    running keeps its own), else the port asked for."""
    try:
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        host = "127.0.0.1" if http.host in ("0.0.0.0", "", None) else http.host
        return ("::1" if host == "::" else host), int(http.port)
    except Exception:  # private API: fall back to what was asked
        return "127.0.0.1", requested


def serve_cluster(a: argparse.Namespace) -> int:
    """Run the cluster until a signal; 0 on a clean stop. Raises ValueError for bad flags."""
    from service.engine_args import cluster_config, engine_config, server_config
    from service.cluster.gate import GateProcess

    engine, net, cluster = engine_config(a), server_config(a), cluster_config(a)
    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        (force if stop.is_set() else stop).set()

    gate = GateProcess(net, cluster.num_replicas)  # raises OSError: the port is taken
    host = f"[{net.host}]" if ":" in net.host else net.host
    print(f"conveyor: listening on http://{host}:{gate.port} (/health says 503 "
          "\"starting\" until every replica is ready); starting Ray ...", flush=True)
    import ray  # seconds of imports: after the port answers
    from ray import serve

    from service.cluster.app import build_app
    started = False
    try:
        started = start_ray(a.ray_address)
        gate.set_reason("starting: Ray Serve is starting")
        requested = free_local_port()
        serve.start(http_options={"host": "127.0.0.1", "port": requested})
        proxy = proxy_address(requested)
        health = cluster.route_prefix.rstrip("/") + "/health"
        gate.set_reason(f"starting: deploying the application; the engine replicas are "
                        f"loading the model (0 of {cluster.num_replicas} ready)")
        gate.open_when_answering(proxy, health)
        scaling = (f"autoscaling {cluster.min_replicas}..{cluster.max_replicas}"
                   if cluster.autoscaling else f"{cluster.num_replicas}")
        print(f"conveyor: deploying {scaling} replicas of "
              f"{a.model or 'SmolLM2-135M-Instruct (default)'} ({cluster.num_cpus_per_replica:g} "
              f"CPU each, {cluster.routing} routing); each loads the model ...", flush=True)
        print(f"conveyor: {routing_note(cluster)}", flush=True)
        handle = serve.run(build_app(engine, net, cluster), name=cluster.app_name,
                           route_prefix=cluster.route_prefix, blocking=False)
        failed = handle.wait_ready.remote().result()
        if failed is not None:
            raise RuntimeError(failed)
        gate.open(proxy)
        print(f"conveyor: serving at ws://{host}:{gate.port}/v1/stream "
              f"(Ray Serve application {cluster.app_name!r}; its proxy at "
              f"{proxy[0]}:{proxy[1]}, behind the gate)", flush=True)
        print(f"conveyor: health at http://{host}:{gate.port}/health", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        while not stop.wait(0.5):
            pass
        print(f"conveyor: shutting down: requests in flight get {net.shutdown_timeout:g} s "
              "(a second signal cancels them now)", flush=True)
        drain = handle.drain.remote(net.shutdown_timeout)
        while True:
            try:
                drain.result(timeout_s=0.5)
                break
            except TimeoutError:
                if force.is_set():
                    force.clear()
                    handle.drain.remote(0.0).result(timeout_s=GRACE_S)
    except KeyboardInterrupt:  # Ctrl-C while deploying
        pass
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            gate.close()
            if started:
                serve.shutdown()
            elif ray.is_initialized():
                serve.delete(cluster.app_name)
        finally:
            ray.shutdown()
    print("conveyor: stopped", flush=True)
    return 0
