"""A recording HTTP proxy for client tests: forwards every request to an upstream server
unchanged (bodies and streamed responses byte for byte) and keeps each exchange, so a test
can check what a client nobody here wrote sent, and what it got back.

Runs uvicorn in a daemon thread on 127.0.0.1, port 0.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Exchange:
    """One forwarded request: its method, path, JSON body (None if not JSON), the upstream
    status, and the response body as received (for SSE: every `data:` line)."""
    method: str
    path: str
    body: Any
    status: int = 0
    response: bytes = b""
    done: bool = False

    def sse_events(self) -> list[dict]:
        """The JSON events of an SSE response (the final `[DONE]` left out)."""
        out = []
        for line in self.response.decode("utf-8", "replace").splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
        return out


@dataclass
class RecordingProxy:
    upstream: str  # e.g. http://127.0.0.1:PORT (no trailing slash)
    exchanges: list[Exchange] = field(default_factory=list)
    port: int = 0

    def start(self) -> RecordingProxy:
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "DELETE"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not (self._server.started and self._server.servers):
            if time.monotonic() > deadline:
                raise RuntimeError("recording proxy did not start")
            time.sleep(0.05)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> StreamingResponse:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        ex = Exchange(request.method, request.url.path, body)
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10))
        upstream = await client.send(client.build_request(
            request.method, self.upstream + request.url.path, params=request.query_params,
            headers=headers, content=raw), stream=True)
        ex.status = upstream.status_code

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    ex.response += chunk
                    yield chunk
            finally:
                ex.done = True
                await upstream.aclose()
                await client.aclose()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def wait_for(predicate, timeout: float, step: float = 0.2) -> bool:
    """Polls `predicate()` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


__all__ = ["Exchange", "RecordingProxy", "wait_for"]
