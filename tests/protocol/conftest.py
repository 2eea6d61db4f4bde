"""A scripted fake server for the client tests: real sockets on port 0.

It plays the server side of PROTOCOL.md only as far as each test scripts it,
so the client's logic is tested in isolation (the real server has its own tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from protocol import Hello, Pong, encode

WAIT_S = 10.0  # upper bound on waiting for an event in a test, never a timing assertion


class FakeServer:
    """Records what the client sends; the test sends the answers.

    Attributes:
        url: ws:// URL of the listening socket.
        first_frame: what a new connection receives first (a Hello by default).
        auto_pong: answer `ping` frames by itself.
        headers: the request headers of the last connection.
    """

    def __init__(self) -> None:
        self.url = ""
        self.first_frame: msgspec.Struct = Hello(protocol=1, model="fake-model", max_model_len=64)
        self.auto_pong = True
        self.headers: Any = None
        self._conn: ServerConnection | None = None
        self._received: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._connected = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        self._conn = ws
        self.headers = ws.request.headers if ws.request else None
        await ws.send(encode(self.first_frame), text=True)
        self._connected.set()
        try:
            async for data in ws:
                frame = msgspec.json.decode(data)
                if self.auto_pong and frame.get("type") == "ping":
                    await ws.send(encode(Pong(t=frame.get("t"))), text=True)
                else:
                    self._received.put_nowait(frame)
        except ConnectionClosed:
            pass

    async def recv(self) -> dict[str, Any]:
        """The next frame the client sent (pings excluded when auto_pong), as a dict."""
        return await asyncio.wait_for(self._received.get(), WAIT_S)

    async def send(self, *msgs: msgspec.Struct) -> None:
        """Send frames to the connected client, in order."""
        await asyncio.wait_for(self._connected.wait(), WAIT_S)
        assert self._conn is not None
        for msg in msgs:
            await self._conn.send(encode(msg), text=True)

    async def send_raw(self, data: str) -> None:
        assert self._conn is not None
        await self._conn.send(data)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection from the server side."""
        assert self._conn is not None
        await self._conn.close(code, reason)


@pytest.fixture
async def fake_server() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    async with serve(server.handler, "127.0.0.1", 0) as ws_server:
        port = next(iter(ws_server.sockets)).getsockname()[1]
        server.url = f"ws://127.0.0.1:{port}/v1/stream"
        yield server


async def _eventually(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), WAIT_S)


@pytest.fixture
def eventually() -> Callable[[Callable[[], bool]], Awaitable[None]]:
    """`await eventually(cond)`: wait until cond() holds (polled), failing after WAIT_S."""
    return _eventually
