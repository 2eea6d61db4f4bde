"""The gate: `conveyor serve --replicas`'s own listener on --host:--port, so that /health
answers from the first moment of start-up (issue 23, item 2).

Ray Serve's HTTP proxy cannot answer early: it binds its port only once Ray is up (about
15 s here), and it holds a request whose route is published while the Ingress replica
is still starting (5 s measured) instead of answering. So the launcher first starts this
gate, which binds the port before Ray starts and relays each TCP connection whole to one
upstream, chosen when the connection is accepted:

    before the Ingress answers   a uvicorn server on 127.0.0.1:<free port> in the
                                 gate's process, running StartingApp
                                 (service/front/starting.py):
                                 /health 503 {"status": "starting", "reason": ...,
                                 "replicas": 0, "expected_replicas": N}, sockets 1013,
                                 the HTTP API 503 model_loading with Retry-After. Every
                                 answer closes its connection (`Connection: close`), so
                                 no client keeps one to it past the switch.
    from then on                 Serve's proxy on 127.0.0.1:<its port>, which routes to
                                 the Ingress (its own /health: "k of N ready", then 200).
                                 A connection the proxy refuses (Serve stopping) is
                                 answered by the local server again.

`open_when_answering(proxy)` switches when the proxy's /health returns the Ingress's JSON
(any status); `open(proxy)` switches at once. The relay is bytes only (HTTP/1.1 and
WebSockets alike, half-closes passed on); each side's write buffer pauses reading on the
other side (asyncio flow control), so a client that stops reading backs up to the
Ingress, which drops it as the single-process front does. The Ingress sees the peer
address 127.0.0.1 (only its logs use it).

Runs in a process of its own (`GateProcess`): the launcher's main thread blocks in Ray
calls and holds the GIL for seconds while it imports and starts Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import ServerConfig
from service.front.access import AccessPolicy
from service.front.server import SignalFreeServer
from service.front.starting import StartingApp

CONNECT_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 1.0
Address = tuple[str, int]


class _Side(asyncio.Protocol):
    """One end of a relayed connection; `peer` is the other end once it is connected."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # bytes that arrived before the peer existed
        self.eof = False  # this end has sent EOF
        self.closed = False
        self._peer_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def link(self, peer: _Side) -> None:
        self.peer = peer
        for data in self.pending:
            peer.send(data)
        self.pending.clear()
        if self.eof:
            peer.send_eof()
        if self.closed:
            peer.close()

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending.append(data)
        else:
            self.peer.send(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self.peer is not None:
            self.peer.send_eof()
        return True  # keep our write side open: the peer may still answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None:
            self.peer.close(abort=exc is not None)

    # flow control: our write buffer is full -> the peer stops reading
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()
            self._peer_paused = True

    def resume_writing(self) -> None:
        if self._peer_paused and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()
            self._peer_paused = False

    # ---- what the peer asks of this end
    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def send_eof(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.eof or not t.can_write_eof():  # both directions ended
            t.close()
        else:
            t.write_eof()

    def close(self, abort: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort() if abort else self.transport.close()


class _ConnectionClose:
    """ASGI middleware: every HTTP answer carries `Connection: close`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send if scope["type"] != "http" else closing)


class Gate:
    """Listens on `config.host:config.port` (port 0: a free one) and relays as above.

    Args:
        config: the `conveyor serve` network flags (host, port, API key, Origins).
        expected_replicas: N, for /health's "expected_replicas" until the Ingress answers.

    `reason` (str) and `failed` (bool) are what the local answers say; the launcher sets
    them as start-up goes on. Raises OSError from `start()` when the port is taken.
    """

    def __init__(self, config: ServerConfig, expected_replicas: int) -> None:
        self.config = config
        self.expected_replicas = expected_replicas
        self.reason = "starting: Ray is starting"
        self.failed = False
        self.upstream: Address | None = None  # None: the local server
        self.relayed = 0  # connections relayed to the upstream so far
        self._local: Address | None = None
        self._local_server: SignalFreeServer | None = None
        self._local_task: asyncio.Task[None] | None = None
        self._listener: asyncio.Server | None = None
        self._port: int | None = None
        self._probe: asyncio.Task[None] | None = None

    def _state(self) -> tuple[str, bool, dict[str, Any]]:
        return self.reason, self.failed, {"replicas": 0,
                                          "expected_replicas": self.expected_replicas}

    async def start(self) -> Gate:
        c = self.config
        starting = StartingApp(AccessPolicy(c.api_key, c.allowed_origins), self._state,
                               lambda: None)
        local = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        local.bind(("127.0.0.1", 0))
        local.listen(256)
        local.setblocking(False)
        self._local = local.getsockname()[:2]
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        server = SignalFreeServer(uvicorn.Config(
            _ConnectionClose(starting), lifespan="off", log_config=None, access_log=False,
            server_header=False, ws_per_message_deflate=False))
        self._local_server = server
        self._local_task = asyncio.create_task(server.serve(sockets=[local]),
                                               name="conveyor-gate-local")
        while not server.started:
            if self._local_task.done():
                self._local_task.result()
            await asyncio.sleep(0.005)
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._accepted, c.host, c.port, reuse_address=True, backlog=2048)
        self._port = int(self._listener.sockets[0].getsockname()[1])
        return self

    @property
    def port(self) -> int:
        """The port listened on (the one asked for, or the free one port 0 got)."""
        assert self._port is not None, "start() first"
        return self._port

    def _accepted(self) -> _Side:
        client = _Side()
        asyncio.get_running_loop().create_task(self._connect(client))
        return client

    async def _connect(self, client: _Side) -> None:
        loop = asyncio.get_running_loop()
        target = self.upstream
        upstream = _Side()
        for addr in ([target] if target is not None else []) + [self._local]:
            assert addr is not None
            try:
                await asyncio.wait_for(loop.create_connection(lambda: upstream, *addr),
                                       CONNECT_TIMEOUT_S)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        else:
            client.close(abort=True)
            return
        if addr == target:
            self.relayed += 1
        upstream.link(client)
        client.link(upstream)

    def open(self, proxy: Address) -> None:
        """Relay every new connection to `proxy` from now on."""
        self.upstream = proxy

    def open_when_answering(self, proxy: Address, health_path: str = "/health") -> None:
        """Switch to `proxy` once its `health_path` returns the Ingress's JSON."""
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(
                self._wait_for(proxy, health_path), name="conveyor-gate-probe")

    async def _wait_for(self, proxy: Address, path: str) -> None:
        while self.upstream is None:
            try:
                if await asyncio.wait_for(_answers(proxy, path), PROBE_TIMEOUT_S):
                    self.open(proxy)
                    return
            except (OSError, asyncio.TimeoutError, ValueError):
                pass
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def close(self) -> None:
        """Stop listening (connections in flight go on until their ends close)."""
        if self._probe is not None:
            self._probe.cancel()
        if self._listener is not None:
            self._listener.close()
        if self._local_server is not None:
            self._local_server.should_exit = True
            if self._local_task is not None:
                await asyncio.wait([self._local_task], timeout=5)


async def _answers(addr: Address, path: str) -> bool:
    """Whether GET `path` at `addr` is answered 200 or 503 with a "status" field (the
    Ingress's /health JSON; Serve's proxy says 404 in text before the route exists)."""
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {addr[0]}\r\nConnection: close\r\n\r\n"
                     .encode())
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.split(b" ", 2)[1:2] in ([b"200"], [b"503"]) and b'"status"' in body


class GateProcess:
    """A Gate in a process of its own, driven from the launcher's synchronous code.

        gate = GateProcess(server_config, expected_replicas=2)   # listening on return
        gate.set_reason("starting: deploying ...")
        gate.open_when_answering(("127.0.0.1", proxy_port))
        gate.close()

    A process, not a thread: the launcher's main thread holds the GIL for seconds at a
    time while it imports Ray and starts it, and a gate on a thread there missed 1-s
    answers (measured: a poll timed out at 1 s about 6 s into start-up). The process is
    `python -m service.cluster.gate`; its settings (the API key included, never on a
    command line) and then its commands go as JSON lines on its stdin, and it ends at
    `close()` or when its stdin closes (the launcher died). It ignores SIGINT, so a
    Ctrl-C in the terminal leaves it answering while the launcher drains.

    Raises OSError (the port is taken, or the gate could not start) from the constructor.
    """

    def __init__(self, config: ServerConfig, expected_replicas: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "service.cluster.gate"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]),
                 os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
        self._send({"host": config.host, "port": config.port, "api_key": config.api_key,
                    "allowed_origins": list(config.allowed_origins),
                    "expected_replicas": expected_replicas})
        assert self._proc.stdout is not None
        answer = self._proc.stdout.readline().strip()
        if not answer.startswith("port "):
            self._proc.kill()
            self._proc.wait()
            raise OSError(f"the gate could not listen on {config.host}:{config.port}: "
                          f"{answer.removeprefix('error ') or 'it exited'}")
        self.port = int(answer.split()[1])

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the gate is gone: nothing to tell it
            pass

    def set_reason(self, reason: str, failed: bool = False) -> None:
        """What the local answers say from now on."""
        self._send({"reason": reason, "failed": failed})

    def open(self, proxy: Address) -> None:
        self._send({"open": list(proxy)})

    def open_when_answering(self, proxy: Address, health_path: str = "/health") -> None:
        self._send({"probe": list(proxy), "path": health_path})

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening and end the process."""
        self._send({"close": True})
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


async def _serve(settings: dict[str, Any]) -> None:
    """The gate process: listen, print "port N", obey stdin's commands until close/EOF."""
    config = ServerConfig(host=settings["host"], port=settings["port"],
                          api_key=settings.get("api_key"),
                          allowed_origins=tuple(settings.get("allowed_origins", ())))
    try:
        gate = await Gate(config, int(settings["expected_replicas"])).start()
    except OSError as e:
        print(f"error {e}", flush=True)
        return
    print(f"port {gate.port}", flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def command(message: dict[str, Any] | None) -> None:
        if message is None or message.get("close"):
            done.set()
        elif "reason" in message:
            gate.reason, gate.failed = message["reason"], bool(message.get("failed"))
        elif "open" in message:
            gate.open(tuple(message["open"]))  # type: ignore[arg-type]
        elif "probe" in message:
            gate.open_when_answering(tuple(message["probe"]),  # type: ignore[arg-type]
                                     message.get("path", "/health"))

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(command, json.loads(line))
        loop.call_soon_threadsafe(command, None)  # EOF: the launcher is gone

    threading.Thread(target=read_stdin, name="conveyor-gate-stdin", daemon=True).start()
    await done.wait()
    await gate.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    settings = json.loads(sys.stdin.readline())
    try:
        import uvloop
        uvloop.run(_serve(settings))
    except ImportError:
        asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
