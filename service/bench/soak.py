"""Soak test: many requests over many connections against the real model, with random
cancels and abrupt disconnects; then checks that nothing leaked (issue 8).

    scripts/soak                       # 1,000 requests over 100 connections
    scripts/soak --requests 100 --connections 10     # a quick run

The server (Engine + FrontServer) runs in this process, on its own event loop in a
thread, so that its asyncio tasks can be counted exactly; the clients run on the main
loop and speak raw WebSocket frames. Checked at the end, each a line of the report:

- blocks: /metrics shows kv_cache_usage_perc == 0, no request running or waiting, no
  open connection, and the pool passes check_integrity();
- requests: the server finished exactly the requests it accepted (request_success_total
  summed over finish reasons), every client that stayed got exactly one `done` each;
- tasks: the server loop holds as many asyncio tasks as before the load, and the process
  as many threads and file descriptors;
- memory: RSS (VmRSS of this process: server and clients) grew by less than
  --rss-limit-mb from the 100th finished request to the last.

Exit status 0 when every check passed, 1 otherwise. Prints a JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import websockets

PROMPTS = ["Hi!", "What is the capital of France?", "Name three colours.",
           "Write a haiku about rain.", "Explain continuous batching in one sentence.",
           "Tell me a joke about computers. " * 3, "List five animals that live in the sea."]


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class ServerThread:
    """Engine + FrontServer on an event loop of their own, in a daemon thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        from service.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="soak-server")
        self.thread.start()
        self.engine_config = EngineConfig(
            cache=CacheConfig(num_kv_blocks=args.num_kv_blocks, swap_space=0.25),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs))
        self.server_config = ServerConfig(port=0, max_connections=args.connections + 16)
        self.engine: Any = None
        self.server: Any = None

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 900) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from service.engine import Engine
        from service.front.server import FrontServer

        self.engine = await Engine(self.engine_config).start()
        self.server = await FrontServer(self.engine, self.server_config).start()

    def start(self) -> None:
        self.call(self._start())

    async def _task_count(self, settle_until: int | None, timeout: float) -> int:
        """Tasks on the server loop (not this one). With `settle_until`, wait up to `timeout`
        s for the count to come down to it: a closed socket's handler ends asynchronously."""
        me = asyncio.current_task()
        deadline = time.monotonic() + timeout
        while True:
            await asyncio.sleep(0.05)
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            if settle_until is None or len(tasks) <= settle_until or time.monotonic() > deadline:
                if settle_until is not None and len(tasks) > settle_until:
                    print("soak: server tasks left:", sorted(t.get_name() for t in tasks),
                          file=sys.stderr)
                return len(tasks)

    def task_count(self, settle_until: int | None = None, timeout: float = 30) -> int:
        return self.call(self._task_count(settle_until, timeout))

    async def _idle(self, timeout: float) -> None:
        ok = await self.engine.wait_idle(timeout)
        deadline = time.monotonic() + timeout
        while self.server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not ok:
            raise TimeoutError("the engine did not go idle")

    def wait_idle(self, timeout: float = 300) -> None:
        self.call(self._idle(timeout), timeout + 60)

    def stop(self) -> None:
        async def close() -> None:
            await self.server.close()
            await self.engine.close()
        self.call(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@dataclass
class Load:
    """The shared state of the load generator."""

    total: int
    rng: random.Random
    args: argparse.Namespace
    issued: int = 0
    finished: int = 0
    accepted: int = 0
    connections: int = 0
    outcomes: Counter = field(default_factory=Counter)
    rss_at_100: float | None = None
    problems: list[str] = field(default_factory=list)

    def next_id(self) -> int | None:
        if self.issued >= self.total:
            return None
        self.issued += 1
        return self.issued

    def finish(self, outcome: str) -> None:
        self.finished += 1
        self.outcomes[outcome] += 1
        if self.finished == min(100, self.total):
            gc.collect()
            self.rss_at_100 = rss_mb()
        if self.finished % 100 == 0:
            print(f"soak: {self.finished}/{self.total} requests, RSS {rss_mb():.0f} MiB",
                  file=sys.stderr, flush=True)


async def _request(ws: Any, n: int, load: Load) -> str:
    """One request on `ws`: "done:<reason>", "refused:<code>", or "dropped" when this
    client cut the connection (the socket is then unusable)."""
    rng, args = load.rng, load.args
    action = rng.choices(["normal", "cancel", "drop"],
                         [1 - args.cancel_prob - args.drop_prob, args.cancel_prob,
                          args.drop_prob])[0]
    params = {"max_tokens": rng.randint(args.min_tokens, args.max_tokens),
              "temperature": rng.choice([0.0, 0.8]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    else:
        body = {"prompt": rng.choice(PROMPTS)}
    rid = f"r{n}"
    await ws.send(json.dumps({"type": "generate", "id": rid, **body, "params": params}))
    dones = 0
    while True:
        msg = json.loads(await ws.recv())
        if msg.get("id") != rid:
            continue
        kind = msg["type"]
        if kind == "accepted":
            load.accepted += 1
            if action == "drop" and rng.random() < 0.5:
                ws.transport.abort()  # no close frame, as a killed client
                return "dropped"
        elif kind == "delta" and action == "cancel":
            await ws.send(json.dumps({"type": "cancel", "id": rid}))
            action = "cancel-sent"
        elif kind == "delta" and action == "drop":
            ws.transport.abort()
            return "dropped"
        elif kind == "error" and msg["code"] != "internal_error":
            return f"refused:{msg['code']}"
        elif kind == "done":
            dones += 1
            # nothing may follow a done: a ping round trip flushes anything still queued
            await ws.send(json.dumps({"type": "ping", "t": float(n)}))
            while True:
                extra = json.loads(await ws.recv())
                if extra["type"] == "pong":
                    break
                if extra.get("id") == rid:
                    load.problems.append(f"{rid}: a {extra['type']} after its done")
            return f"done:{msg['finish_reason']}"


async def _client(load: Load, url: str) -> None:
    """One connection's worth of sequential requests; reconnects after dropping."""
    ws = None
    try:
        while (n := load.next_id()) is not None:
            if ws is None:
                ws = await websockets.connect(url, max_size=None)
                load.connections += 1
                await ws.recv()  # hello
            outcome = await _request(ws, n, load)
            if outcome == "dropped":
                ws = None
            load.finish(outcome)
    finally:
        if ws is not None:
            await ws.close()


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    pat = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", re.M)
    for m in pat.finditer(text):
        if labels in m.group(1):
            total += float(m.group(2))
    return total


async def _scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data.decode().partition("\r\n\r\n")[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    p.add_argument("--connections", type=int, default=100, help="concurrent connections")
    p.add_argument("--min-tokens", type=int, default=4, help="smallest max_tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens")
    p.add_argument("--cancel-prob", type=float, default=0.1, help="share cancelled mid-stream")
    p.add_argument("--drop-prob", type=float, default=0.05,
                   help="share whose client drops the TCP connection without a close frame")
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch size")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV cache blocks")
    p.add_argument("--rss-limit-mb", type=float, default=50.0,
                   help="allowed RSS growth from the 100th to the last request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log level (logs go to stderr; the report to stdout)")
    a = p.parse_args(argv)
    if a.requests < 1 or a.connections < 1 or not 1 <= a.min_tokens <= a.max_tokens \
            or a.cancel_prob + a.drop_prob > 1:
        p.error("need requests, connections >= 1, 1 <= min-tokens <= max-tokens, "
                "cancel-prob + drop-prob <= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from service.logs import configure_logging

    configure_logging(args.log_level)
    print("soak: loading the model ...", file=sys.stderr, flush=True)
    server = ServerThread(args)
    server.start()
    port, url = server.server.port, server.server.url
    gc.collect()
    before = {"tasks": server.task_count(), "threads": threading.active_count(),
              "fds": open_fds(), "rss_mb": rss_mb()}
    load = Load(args.requests, random.Random(args.seed), args)
    t0 = time.monotonic()

    async def run() -> None:
        await asyncio.gather(*(_client(load, url) for _ in range(args.connections)))

    asyncio.run(run())
    elapsed = time.monotonic() - t0
    gc.collect()
    rss_end = rss_mb()
    server.wait_idle()
    metrics = asyncio.run(_scrape(port))
    after = {"tasks": server.task_count(settle_until=before["tasks"]),
             "threads": threading.active_count(), "fds": open_fds(), "rss_mb": rss_end}
    finished_by_server = _metric(metrics, "conveyor:request_success_total")
    checks = {
        "kv_cache_usage_perc == 0": _metric(metrics, "conveyor:kv_cache_usage_perc") == 0,
        "num_requests_running == 0": _metric(metrics, "conveyor:num_requests_running") == 0,
        "num_requests_waiting == 0": _metric(metrics, "conveyor:num_requests_waiting") == 0,
        "websocket_connections == 0": _metric(metrics, "conveyor:websocket_connections") == 0,
        "pool check_integrity": _integrity(server),
        "server finished every accepted request": finished_by_server == load.accepted,
        "nothing after a done": not load.problems,
        "server tasks back to baseline": after["tasks"] == before["tasks"],
        "threads back to baseline": after["threads"] == before["threads"],
        "fds back to baseline": after["fds"] == before["fds"],
        f"RSS growth 100th->last < {args.rss_limit_mb:g} MB":
            load.rss_at_100 is not None and rss_end - load.rss_at_100 < args.rss_limit_mb,
    }
    report = {
        "requests": load.finished, "connections_opened": load.connections,
        "accepted": load.accepted, "finished_by_server": finished_by_server,
        "outcomes": dict(sorted(load.outcomes.items())), "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(load.finished / elapsed, 2), "before": before, "after": after,
        "rss_at_100th_mb": None if load.rss_at_100 is None else round(load.rss_at_100, 1),
        "rss_growth_mb": None if load.rss_at_100 is None else round(rss_end - load.rss_at_100, 1),
        "problems": load.problems[:20], "checks": checks,
    }
    server.stop()
    print(json.dumps(report, indent=2))
    failed = [name for name, ok in checks.items() if not ok]
    print("soak: " + ("all checks passed" if not failed else "FAILED: " + "; ".join(failed)),
          file=sys.stderr)
    return 1 if failed else 0


def _integrity(server: ServerThread) -> bool:
    async def check() -> bool:
        server.engine.scheduler.check_integrity()
        return server.engine.scheduler.pool.usage == 0.0
    try:
        return server.call(check())
    except AssertionError as e:
        print(f"soak: check_integrity failed: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    sys.exit(main())
