"""The files one request crosses, traced, against docs/module-map.md: a WebSocket `generate`
on /v1/stream and an HTTP chat completion, each on a real FrontServer over a model-free
runner (TinyRunner). Issue 49 bounds them: at most 16 and 15 project files.

Counted: every file of protocol/ and service/ in which a line runs while the second request
of a connection is served (the first warms the caches), in any thread. Not counted:
service.core, which the step loop calls (its scheduler, pool and engine core), but
service/core/request.py is, as Engine.add_request builds the Request. The client is a plain
websockets / httpx one, so no project file runs on its side.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import httpx
import websockets

from service.config import ServerConfig
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.engine import Engine
from service.front.server import FrontServer
from tests.support.tiny_model import TinyRunner

ROOT = Path(__file__).resolve().parents[2]
PREFIX = str(ROOT) + "/"
MAP = ROOT / "docs" / "module-map.md"
MAX_WS, MAX_HTTP = 16, 15


class LineTrace:
    """The project files in which a line ran between start() and stop(), every thread."""

    def __init__(self) -> None:
        self.files: set[str] = set()

    def _local(self, frame, event, arg):
        if event == "line":
            self.files.add(frame.f_code.co_filename[len(PREFIX):])
        return self._local

    def _global(self, frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(PREFIX) and "/tests/" not in name:
            return self._local
        return None

    def start(self) -> None:
        self.files.clear()
        threading.settrace(self._global)
        sys.settrace(self._global)

    def stop(self) -> set[str]:
        sys.settrace(None)
        threading.settrace(None)
        return {f for f in self.files if f.startswith(("protocol/", "service/")) and
                (not f.startswith("service/core/") or f == "service/core/request.py")}


def _mapped(heading: str) -> set[str]:
    """The files the module map lists in the code block after the line starting `heading`."""
    text = MAP.read_text(encoding="utf-8")
    block = text[text.index(heading):].split("```")[1]
    return set(re.findall(r"^((?:protocol|service)/\S+\.py)", block, re.M))


async def _crossed() -> tuple[set[str], set[str]]:
    cfg = EngineConfig(cache=CacheConfig(block_size=4),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64))
    engine = await Engine(cfg, runner=TinyRunner()).start()
    server = await FrontServer(engine, ServerConfig(port=0)).start()
    trace = LineTrace()
    try:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/stream") as ws:
            for k in range(2):
                if k:
                    trace.start()
                await ws.send(json.dumps({"type": "generate", "id": f"r{k}",
                                          "messages": [{"role": "user", "content": "hi"}],
                                          "params": {"max_tokens": 3}}))
                while json.loads(await ws.recv())["type"] != "done":
                    pass
            ws_files = trace.stop()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            for k in range(2):
                if k:
                    trace.start()
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            http_files = trace.stop()
    finally:
        trace.stop()
        await server.close()
        await engine.close()
    return ws_files, http_files


async def test_the_files_a_request_crosses_are_the_module_maps_and_within_bounds():
    ws_files, http_files = await _crossed()
    assert ws_files == _mapped("A WebSocket `generate`"), sorted(ws_files)
    assert http_files == _mapped("An HTTP `POST /v1/chat/completions`"), sorted(http_files)
    assert len(ws_files) <= MAX_WS and len(http_files) <= MAX_HTTP
