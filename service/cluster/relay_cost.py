"""CPU cost of the cluster's front per streamed token: what N machines would run out of first.

    python -m service.cluster.relay_cost [--requests 16] [--max-tokens 128]

Starts Ray (2 CPUs) with 2 replicas (0.5 CPU, 1 torch thread each) and the ingress,
streams `--requests` concurrent greedy requests of `--max-tokens` tokens through the real
endpoint, and reads the CPU time (user + system, from the OS) that each Ray process spent
meanwhile: Serve's HTTP proxy (WebSocket frames in and out), the ingress (admission,
routing, relaying each replica's event batches to the socket) and the replicas (the
engines). Prints CPU milliseconds per 1,000 streamed tokens for each, and the tokens per
second one core could relay at that cost. CPU time, unlike wall time, stays meaningful on
a shared machine (only caches are shared).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import psutil

from protocol import connect


def _ray_processes() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {"proxy": [], "ingress": [], "replicas": []}
    for p in psutil.process_iter(["cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        if title.startswith("ray::ProxyActor"):
            found["proxy"].append(p)
        elif title.startswith("ray::ServeReplica:conveyor:Ingress"):
            found["ingress"].append(p)
        elif title.startswith("ray::ServeReplica:conveyor:EngineReplica"):
            found["replicas"].append(p)
    return found


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


async def _stream(url: str, requests: int, max_tokens: int) -> int:
    async def one(i: int, client) -> int:
        n = 0
        async for ev in client.generate(prompt=f"Story {i}: once upon a time,",
                                        max_tokens=max_tokens, ignore_eos=True, temperature=0):
            n += len(getattr(ev, "token_ids", ()))
        return n

    async with await connect(url) as client:
        return sum(await asyncio.gather(*(one(i, client) for i in range(requests))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.cluster.relay_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--port", type=int, default=8799, help="Serve's HTTP proxy port")
    a = p.parse_args(argv)

    import ray
    from ray import serve

    from service.cluster.app import build_app
    from service.cluster.config import ClusterConfig
    from service.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                ServerConfig)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        engine = EngineConfig(model=ModelConfig(num_threads=1),
                              cache=CacheConfig(num_kv_blocks=1024, swap_space=0.0),
                              scheduler=SchedulerConfig(max_num_seqs=a.requests))
        serve.run(build_app(engine, ServerConfig(port=a.port),
                            ClusterConfig(num_replicas=2, num_cpus_per_replica=0.5)),
                  name="conveyor", blocking=False)
        url = f"ws://127.0.0.1:{a.port}/v1/stream"
        asyncio.run(_stream(url, 2, 8))  # warm-up
        procs = _ray_processes()
        before = {k: _cpu_s(v) for k, v in procs.items()}
        t0 = time.monotonic()
        tokens = asyncio.run(_stream(url, a.requests, a.max_tokens))
        wall = time.monotonic() - t0
        after = {k: _cpu_s(v) for k, v in procs.items()}
        print(f"{tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tokens/s), "
              f"{a.requests} concurrent requests; processes: "
              + ", ".join(f"{k} x{len(v)}" for k, v in procs.items()))
        for k in procs:
            ms = (after[k] - before[k]) * 1e3 / tokens * 1000
            rate = 1e6 / ms if ms > 0 else float("inf")
            print(f"  {k:<9} {ms:8.1f} CPU ms per 1,000 tokens   "
                  f"(one core: {rate:,.0f} tokens/s)")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
