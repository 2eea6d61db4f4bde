"""`conveyor serve` as a real subprocess: SIGTERM drains it gracefully (issue 8, item 5)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.integration.reliability_support import RawClient, generate_frame, http_get, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.model


class _Server:
    """A `conveyor serve` subprocess whose stdout and stderr are read continuously (so that a
    full pipe can never block it)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [asyncio.create_task(self._read(proc.stdout, self.stdout)),
                         asyncio.create_task(self._read(proc.stderr, self.stderr))]

    @staticmethod
    async def _read(stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            into.append(line.decode("utf-8", "replace"))

    async def _port_from(self, pattern: str, timeout: float) -> int:
        """The port in the first stdout line matching `pattern` (its group 1)."""
        async def find() -> int:
            while True:
                for line in self.stdout:
                    m = re.search(pattern, line)
                    if m:
                        return int(m.group(1))
                assert self.proc.returncode is None, "".join(self.stderr)[-3000:]
                await asyncio.sleep(0.05)
        return await asyncio.wait_for(find(), timeout)

    async def port(self) -> int:
        """Wait for the "serving" line (model load: ~30 s here, more on a busy machine)."""
        return await self._port_from(r"serving .* at ws://127\.0\.0\.1:(\d+)/v1/stream", 600)

    async def loading_port(self) -> int:
        """The port from the first line, printed before the model loads."""
        return await self._port_from(
            r"loading .* health at http://127\.0\.0\.1:(\d+)/health", 120)

    async def finish(self) -> int:
        code = await asyncio.wait_for(self.proc.wait(), 120)
        await asyncio.gather(*self._readers)
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await asyncio.gather(*self._readers)


async def _start_server(*flags: str) -> _Server:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service.cli", "serve", "--port", "0", "--num-kv-blocks", "64",
        "--swap-space", "0", "--log-level", "info", *flags,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return _Server(proc)


async def test_sigterm_drains_cancels_after_timeout_closes_1001_exits_0():
    timeout_s = 3.0
    server = await _start_server("--shutdown-timeout", str(timeout_s))
    try:
        port = await server.port()
        assert (await http_get(port, "/health"))[0] == 200
        client = await RawClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
        # 64 blocks of 16 tokens hold 1024: the prompt and 1000 tokens fit
        await client.ws.send(generate_frame("long", max_tokens=1000, ignore_eos=True))
        await wait_until(lambda: "delta" in client.kinds("long") or client.ended("long"), 120,
                         "streaming")
        assert "delta" in client.kinds("long"), client.frames["long"]
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 60
        while (await http_get(port, "/health"))[0] != 503:  # the drain starts at once
            assert time.monotonic() < deadline, "/health did not turn 503"
            await asyncio.sleep(0.01)
        await client.ws.send(generate_frame("late", max_tokens=2))
        late = await client.wait_ended("late", 60)
        assert late[0]["type"] == "error" and late[0]["code"] == "shutting_down"
        long = await client.wait_ended("long", 120)
        waited = time.monotonic() - signalled
        assert long[-1]["type"] == "done" and long[-1]["finish_reason"] == "cancelled"
        assert waited >= timeout_s * 0.9, "cancelled before --shutdown-timeout ran out"
        await wait_until(lambda: client.closed, 60, "the socket to close")
        assert client.close_code == 1001
        assert await server.finish() == 0
    finally:
        await server.kill()
    stdout, stderr = "".join(server.stdout), "".join(server.stderr)
    events = [json.loads(ln)["event"] for ln in stderr.splitlines() if ln.startswith("{")]
    assert "shutdown_started" in events and "shutdown_cancelling" in events
    # the start-up heap was frozen before the first request (service/gc_heap.py)
    assert events.index("gc_heap_frozen") > events.index("engine_ready")
    assert events.index("shutdown_finished") > events.index("shutdown_cancelling")
    assert "conveyor: stopped" in stdout and "Traceback" not in stderr


async def test_health_answers_503_starting_while_loading_and_a_signal_stops_at_once():
    server = await _start_server()
    try:
        port = await server.loading_port()
        status, _, body = await http_get(port, "/health")
        assert status == 503, body  # the model takes seconds to load: still loading
        assert json.loads(body)["status"] == "starting" and "loading" in json.loads(body)["reason"]
        status, headers, _ = await http_get(port, "/v1/models")
        assert status == 503 and int(headers["retry-after"]) > 0
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert await server.finish() == 0
        assert time.monotonic() - signalled < 10, "the load was waited for"
    finally:
        await server.kill()
    assert "conveyor: stopped while loading" in "".join(server.stdout)
