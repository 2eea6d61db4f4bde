"""The gate (service/cluster/gate.py) on real sockets, without Ray: its own start-up
answers, the switch to an upstream once that answers, and the byte relay (WebSockets,
half-close, flow control against a reader that stops, an upstream that goes away)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
import websockets

from service.cluster.gate import Gate
from service.config import ServerConfig
from service.front.server import FrontServer


async def _get(port: int, path: str, close: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on its own connection; (status, headers, body) read to EOF
    (the client asks for `Connection: close` only when `close`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ask = "Connection: close\r\n" if close else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{ask}\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 5)  # EOF: the answer closed the connection
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


def _on(loop: str, test: Callable[[Gate], Awaitable[None]]) -> None:
    """Run `test(gate)` on a fresh gate, on asyncio's own loop or on uvloop (which the
    launcher uses where it is installed)."""
    if loop == "uvloop":
        factory = pytest.importorskip("uvloop").new_event_loop
    else:
        factory = asyncio.new_event_loop

    async def main() -> None:
        gate = await Gate(ServerConfig(host="127.0.0.1", port=0), expected_replicas=2).start()
        try:
            await test(gate)
        finally:
            await gate.close()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


loops = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@loops
def test_before_the_ingress_answers_the_gate_says_starting_and_closes(loop):
    _on(loop, _before_the_ingress_answers_the_gate_says_starting_and_closes)


async def _before_the_ingress_answers_the_gate_says_starting_and_closes(gate):
    status, headers, body = await _get(gate.port, "/health")
    assert status == 503 and headers["connection"] == "close"
    assert json.loads(body) == {"status": "starting", "reason": "starting: Ray is starting",
                                "replicas": 0, "expected_replicas": 2}
    gate.reason = "starting: deploying the application"
    status, headers, body = await _get(gate.port, "/v1/models")
    assert status == 503 and headers["retry-after"] == "5"
    error = json.loads(body)["error"]
    assert error["code"] == "model_loading" and "deploying" in error["message"]
    with pytest.raises(websockets.ConnectionClosed) as closed:
        async with websockets.connect(f"ws://127.0.0.1:{gate.port}/v1/stream") as ws:
            await ws.recv()
    assert closed.value.rcvd.code == 1013 and "loading" in closed.value.rcvd.reason
    gate.failed, gate.reason = True, "the engine replicas failed to start: boom"
    status, _, body = await _get(gate.port, "/health")
    assert status == 503 and json.loads(body)["status"] == "unavailable"
    assert gate.relayed == 0


@loops
def test_the_port_taken_is_an_os_error(loop):
    _on(loop, _the_port_taken_is_an_os_error)


async def _the_port_taken_is_an_os_error(gate):
    with pytest.raises(OSError):
        await Gate(ServerConfig(host="127.0.0.1", port=gate.port), 1).start()


@loops
def test_switches_once_the_upstream_answers_its_health_json(loop):
    _on(loop, _switches_once_the_upstream_answers_its_health_json)


async def _switches_once_the_upstream_answers_its_health_json(gate):
    with socket.socket() as s:  # a port with nothing on it yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gate.open_when_answering(("127.0.0.1", port))
    await asyncio.sleep(0.6)  # refused probes: still local
    assert json.loads((await _get(gate.port, "/health"))[2])["reason"] == \
        "starting: Ray is starting"
    upstream = await FrontServer(None, ServerConfig(host="127.0.0.1", port=port),
                                 starting="the upstream's own answer").start()
    try:
        t0 = time.monotonic()
        while gate.upstream is None and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert gate.upstream == ("127.0.0.1", port)
        status, _, body = await _get(gate.port, "/health", close=True)
        assert status == 503 and json.loads(body)["reason"] == \
            "starting: the upstream's own answer"
        assert gate.relayed >= 1
    finally:
        await upstream.close()
    # the upstream went away: the gate answers again rather than refusing
    status, _, body = await _get(gate.port, "/health")
    assert status == 503 and json.loads(body)["status"] == "starting"


@loops
def test_a_404_in_text_does_not_switch(loop):
    _on(loop, _a_404_in_text_does_not_switch)


async def _a_404_in_text_does_not_switch(gate):
    async def not_found(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_found, "127.0.0.1", 0)
    try:
        gate.open_when_answering(server.sockets[0].getsockname()[:2])
        await asyncio.sleep(1.0)
        assert gate.upstream is None
    finally:
        server.close()


@loops
def test_websocket_frames_both_ways_through_the_relay(loop):
    _on(loop, _websocket_frames_both_ways_through_the_relay)


async def _websocket_frames_both_ways_through_the_relay(gate):
    async def echo(ws):
        async for message in ws:
            await ws.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0, max_size=None) as upstream:
        gate.open(upstream.sockets[0].getsockname()[:2])
        async with websockets.connect(f"ws://127.0.0.1:{gate.port}/",
                                      max_size=None) as ws:
            for i in range(200):
                await ws.send(f"token {i}")
                assert await ws.recv() == f"token {i}"
            big = bytes(range(256)) * 8192  # 2 MiB in one frame
            await ws.send(big)
            assert await ws.recv() == big
    assert gate.relayed == 1


@loops
def test_half_close_then_the_answer(loop):
    _on(loop, _half_close_then_the_answer)


async def _half_close_then_the_answer(gate):
    async def answer_after_eof(reader, writer):
        data = await reader.read()  # to EOF: the client shut its write side
        writer.write(b"got " + str(len(data)).encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_after_eof, "127.0.0.1", 0)
    try:
        gate.open(server.sockets[0].getsockname()[:2])
        reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(b"x" * 100_000)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b"got 100000"
        writer.close()
    finally:
        server.close()


@loops
def test_a_reader_that_stops_backs_up_to_the_upstream(loop):
    _on(loop, _a_reader_that_stops_backs_up_to_the_upstream)


async def _a_reader_that_stops_backs_up_to_the_upstream(gate):
    """The upstream writes as fast as it may (awaiting drain) while the client reads
    nothing: what the upstream got rid of stays bounded by the buffers on the way; then
    the client reads everything, intact."""
    chunk = bytes(range(256)) * 256  # 64 KiB
    total = 256 * 1024 * 1024
    sent = 0

    async def flood(reader, writer):
        nonlocal sent
        while sent < total:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    try:
        gate.open(server.sockets[0].getsockname()[:2])
        reader, writer = await asyncio.open_connection("127.0.0.1", gate.port, limit=2**16)
        await asyncio.sleep(1.5)
        stalled = sent
        assert stalled < 64 * 1024 * 1024, stalled  # bounded: kernel and asyncio buffers
        digest, got = hashlib.sha256(), 0
        while data := await asyncio.wait_for(reader.read(1 << 20), 30):
            digest.update(data)
            got += len(data)
        assert got == total
        assert digest.hexdigest() == hashlib.sha256(chunk * (total // len(chunk))).hexdigest()
        writer.close()
    finally:
        server.close()


def test_the_gate_process_as_the_launcher_drives_it():
    """GateProcess: its own process, so the launcher's GIL never delays an answer; it
    ignores SIGINT (the launcher drains first), refuses a taken port with OSError, and
    ends at close() or when its stdin closes."""
    import os
    import signal
    import urllib.error
    import urllib.request

    from service.cluster.gate import GateProcess

    def health(port: int) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    gate = GateProcess(ServerConfig(host="127.0.0.1", port=0), expected_replicas=3)
    try:
        assert health(gate.port) == (503, {"status": "starting", "reason":
                                           "starting: Ray is starting", "replicas": 0,
                                           "expected_replicas": 3})
        gate.set_reason("starting: deploying the application")
        time.sleep(0.2)
        assert health(gate.port)[1]["reason"] == "starting: deploying the application"
        os.kill(gate._proc.pid, signal.SIGINT)  # a Ctrl-C reaches the whole group
        time.sleep(0.3)
        assert gate._proc.poll() is None and health(gate.port)[0] == 503
        with pytest.raises(OSError, match="could not listen"):
            GateProcess(ServerConfig(host="127.0.0.1", port=gate.port), 1)
    finally:
        gate.close()
    assert gate._proc.returncode == 0
    with pytest.raises(OSError):  # no longer listening
        socket.create_connection(("127.0.0.1", gate.port), timeout=1).close()
    orphan = GateProcess(ServerConfig(host="127.0.0.1", port=0), 1)
    orphan._proc.stdin.close()  # the launcher died: stdin's EOF ends the gate
    assert orphan._proc.wait(10) == 0
