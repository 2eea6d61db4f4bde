"""A real Conveyor server (the real model, port 0) in a thread of its own, for tests that
use synchronous HTTP clients (the openai SDK, LangChain) against it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from service.config import ServerConfig
from service.engine import Engine
from service.front.server import FrontServer
from tests.integration.conftest import engine_config


class ThreadedServer:
    """`Engine` + `FrontServer` on an event loop in a daemon thread.

    `base_url` is http://127.0.0.1:PORT/v1 (the openai SDK's base_url); `call(fn)` runs a
    function on the server's loop and returns its result (to read engine state safely).
    """

    def __init__(self, loaded: Any, server_config: ServerConfig | None = None, **engine_kw) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready: Future[None] = Future()
        self._stop: asyncio.Event | None = None
        self._server_config = server_config or ServerConfig(port=0)
        self._args = (loaded, engine_kw)
        self.engine: Engine | None = None
        self.server: FrontServer | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-server")

    def start(self) -> ThreadedServer:
        self._thread.start()
        self._ready.result(timeout=600)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        loaded, kw = self._args
        self._stop = asyncio.Event()
        try:
            async with Engine(engine_config(**kw), loaded=loaded) as engine:
                self.engine = engine
                self.server = await FrontServer(engine, self._server_config).start()
                self._ready.set_result(None)
                await self._stop.wait()
                await self.server.close()
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return self.server.http_url + "/v1"

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def idle(self) -> tuple[int, float]:
        """(requests running or waiting, KV usage 0..1), read on the server's loop."""
        def read() -> tuple[int, float]:
            assert self.engine is not None
            return self.engine.num_unfinished, self.engine.scheduler.pool.usage
        return self.call(read)

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
