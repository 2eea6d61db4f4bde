"""Helpers shared by the test_reliability_* files: plain HTTP, a raw frame-level client,
a slow (small receive window) socket, and a recorder of every scheduled step."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from service.engine import Engine


async def http_get(port: int, path: str, headers: dict[str, str] | None = None
                   ) -> tuple[int, dict[str, str], str]:
    """(status, lower-cased headers, body) of one plain HTTP/1.1 GET on 127.0.0.1."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}"
                 "Connection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.decode("utf-8", "replace").partition("\r\n\r\n")
    lines = head.split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), hdrs, body


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `cond` every 10 ms; AssertionError naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)


async def wait_idle(engine: Engine, timeout: float = 120.0) -> None:
    await wait_until(lambda: not engine.num_unfinished and not engine.scheduler.has_unfinished(),
                     timeout, "the engine to go idle")


def generate_frame(rid: str, prompt: str = "Tell me a long story about the sea.",
                   **params: Any) -> str:
    return json.dumps({"type": "generate", "id": rid, "prompt": prompt,
                       "params": {"temperature": 0, **params}})


@dataclass
class RawClient:
    """A WebSocket whose frames are collected per request id by a reader task.

    `frames[id]` lists that request's frames as dicts (with "_at": the monotonic arrival
    time added); `untied` the frames without an id;
    `close_code` is the code the socket closed with (1006: no close frame).
    """

    ws: ClientConnection
    frames: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    untied: list[dict] = field(default_factory=list)
    closed: bool = False
    close_code: int | None = None
    _reader: asyncio.Task | None = None

    @classmethod
    async def connect(cls, url: str, **kw: Any) -> RawClient:
        ws = await websockets.connect(url, **kw)
        client = cls(ws)
        client._reader = asyncio.create_task(client._read())
        return client

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                msg = json.loads(data)
                msg["_at"] = time.monotonic()  # arrival time, for latency measurements
                rid = msg.get("id")
                (self.frames[rid] if rid is not None else self.untied).append(msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.closed = True

    def kinds(self, rid: str) -> list[str]:
        return [f["type"] if f["type"] != "error" else f"error:{f['code']}"
                for f in self.frames.get(rid, [])]

    def ended(self, rid: str) -> bool:
        k = self.kinds(rid)
        return bool(k) and (k[-1] == "done" or (k[-1].startswith("error") and "accepted" not in k))

    async def wait_ended(self, rid: str, timeout: float = 120.0) -> list[dict]:
        await wait_until(lambda: self.ended(rid) or self.closed, timeout,
                         f"the end of {rid}")
        return self.frames[rid]

    def text(self, rid: str) -> tuple[str, list[int]]:
        deltas = [f for f in self.frames.get(rid, []) if f["type"] == "delta"]
        return "".join(d["text"] for d in deltas), [t for d in deltas for t in d["token_ids"]]

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await self._reader

    def abort(self) -> None:
        """Drop the TCP connection without a close frame (as a killed client does)."""
        self.ws.transport.abort()


async def small_window_connect(url: str, port: int, rcvbuf: int = 4096,
                               **kw: Any) -> ClientConnection:
    """A client socket with a tiny receive buffer (set before connect, so the TCP window
    stays small): once it stops reading, the server's writes back up within a few KB.
    It offers no compression (permessage-deflate shrinks repetitive frames many times, so
    the buffers would hold far more of them). Its keepalive is off: a client that does not
    read cannot see its pongs, and would drop the connection itself (1011) after
    ping_interval + ping_timeout."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    kw.setdefault("ping_interval", None)
    kw.setdefault("compression", None)
    return await websockets.connect(url, sock=sock, max_queue=1, **kw)


class StepRecorder:
    """Wraps `engine.scheduler.schedule` to record, per step: the engine's step count when
    the step was built, the request ids the scheduler still holds, and those it runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[tuple[int, set[str], set[str]]] = []
        sched = engine.scheduler
        original = sched.schedule

        def schedule():
            held = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
            out = original()
            self.steps.append((engine.num_steps, held, {s.request_id for s in out.sequences}))
            return out

        sched.schedule = schedule  # type: ignore[method-assign]
