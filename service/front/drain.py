"""Graceful drain of a front: the shutdown sequence both servers (``service.front.server``
and the baseline ``service.front.ws_server``) run before closing their sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from service.engine_client import EngineClient

log = structlog.get_logger(__name__)


async def drain(engine: EngineClient, timeout: float, close_timeout: float,
                force: asyncio.Event | None, abort_all: Callable[[], None]) -> bool:
    """Stop admitting (`shutting_down`, /health 503), let requests in flight finish for
    `timeout` seconds or until `force` is set, then `abort_all()` (each request still gets
    its Done, "cancelled") and wait up to `close_timeout` s for them to go.
    Returns True when every request finished on its own."""
    engine.begin_shutdown()
    log.info("shutdown_started", requests_in_flight=engine.num_unfinished, timeout_s=timeout)
    waits = [asyncio.ensure_future(engine.wait_idle(timeout))]
    if force is not None:
        waits.append(asyncio.ensure_future(force.wait()))
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    finished = waits[0] in done and waits[0].result()
    if not finished:
        log.warning("shutdown_cancelling", requests_in_flight=engine.num_unfinished)
        abort_all()
        await engine.wait_idle(close_timeout)
    return finished
