"""The Scheduler + StepLoop actor: one asyncio task around EngineCore.

Between steps it hands EngineCore the requests Admission queued and the cancels
that came in; it runs `EngineCore.step()` (schedule, forward, sample, stop checks)
in a dedicated worker thread, so the event loop keeps streaming meanwhile; and it
gives each step's outputs to the OutputProcessor, which writes every request's
events to its sink. A request's fault fails that request (EngineCore); if this loop
itself dies, every request in flight still gets its error and Done, and the loop
records why (Engine.health reports it).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

import structlog

from protocol import InternalError
from service.core.engine_core import EngineCore, RequestOutput
from service.engine.faults import FaultPlan
from service.engine.metrics import EngineMetrics
from service.engine.output_processor import LiveRequest, OutputProcessor

log = structlog.get_logger("service.engine")

__all__ = ["StepLoop"]


class StepLoop:
    """Args:
        core: the EngineCore to step; executor: its one worker thread.
        metrics: Prometheus metrics or None; faults: the engine's (test-only) fault plan.
    """

    def __init__(self, core: EngineCore, executor: Executor, metrics: EngineMetrics | None,
                 faults: FaultPlan) -> None:
        self.core = core
        self.executor = executor
        self.metrics = metrics
        self.faults = faults
        self.outputs = OutputProcessor(core, metrics)
        self.inbox: asyncio.Queue[LiveRequest] = asyncio.Queue()
        self.live: dict[str, LiveRequest] = {}  # admitted, no Done yet
        self.aborts: set[str] = set()
        self.closing = False
        self.error: BaseException | None = None  # why the loop died
        self.step_started: float | None = None  # monotonic start of the step running now
        self._wakeup = asyncio.Event()

    # ---- from other tasks ---------------------------------------------------------------
    def submit(self, live: LiveRequest) -> None:
        """Queue an admitted request for the next step."""
        self.inbox.put_nowait(live)
        self.live[live.req.request_id] = live
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Cancel at the next step (its Done says "cancelled"); unknown ids are ignored."""
        if request_id in self.live:
            self.aborts.add(request_id)
            self._wakeup.set()

    def close(self) -> None:
        """Cancel everything in flight; the loop returns once they have ended."""
        self.closing = True
        self.aborts.update(self.live)
        self._wakeup.set()

    # ---- the task -----------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run_steps()
        except Exception as e:
            self.error = e
            log.exception("step_loop_died", requests_in_flight=len(self.live))
            self._fail_everything(e)

    async def _run_steps(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            self._admit()
            self._apply_aborts()
            if not core.has_unfinished():
                if self.closing:
                    return
                core.check_integrity()
                self._wakeup.clear()
                if self.inbox.empty() and not self.aborts:
                    await self._wakeup.wait()
                continue
            steps_before = core.num_steps
            self.step_started = time.monotonic()
            try:
                results = await loop.run_in_executor(self.executor, core.step)
            finally:
                self.step_started = None
            if self.metrics is not None and core.num_steps > steps_before:
                self.metrics.iteration_tokens.observe(core.last_num_batched_tokens)
            if results:
                self.process(results)
            elif core.num_steps == steps_before:
                await self._idle()

    async def _idle(self) -> None:
        """Nothing could run: wait for new input, or until a dynamic batch is due."""
        due = self.core.idle_until()
        timeout = None if due is None else max(0.0, due - time.monotonic())
        if due is None and not self.core.scheduler.running:
            log.warning("empty_step", waiting=len(self.core.scheduler.waiting))
            timeout = 0.005
        self._wakeup.clear()
        if not self.inbox.empty() or self.aborts:
            return  # came in during the step that found nothing to run: admit it first
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def process(self, results: list[RequestOutput]) -> None:
        """Send the events of a step's (or a cancel's) outputs."""
        if self.faults.faults:
            results = self._output_faults(results)
        outputs = self.outputs
        outputs.process(results)
        for r in results:  # drop what ended from the loop's own table
            if r.finish_reason is not None or r.request_id not in outputs.live:
                self.live.pop(r.request_id, None)

    def _output_faults(self, results: list[RequestOutput]) -> list[RequestOutput]:
        """Test-only: the "output" faults, raised where output processing would."""
        kept: list[RequestOutput] = []
        for r in results:
            try:
                self.faults.fire("output", [r.request_id])
                kept.append(r)
            except Exception as e:  # noqa: BLE001 -- as OutputProcessor does for its own
                log.error("output_processing_failed", request_id=r.request_id, error=str(e))
                kept += self.core.finish_request(r.request_id, "error", str(e)) or \
                    [RequestOutput(r.request_id, [], "error", str(e))]
        return kept

    def _admit(self) -> None:
        while not self.inbox.empty():
            live = self.inbox.get_nowait()
            if live.req.request_id not in self.live:
                continue  # ended before it reached the core
            self.core.add_request(live.req)
            self.outputs.add(live)

    def _apply_aborts(self) -> None:
        if not self.aborts:
            return
        aborts, self.aborts = self.aborts, set()
        for rid in aborts:
            self.process(self.core.abort(rid))

    def _fail_everything(self, error: BaseException) -> None:
        """The loop died: every request in flight gets its error and Done, nothing hangs."""
        while not self.inbox.empty():  # accepted but never stepped: they end here too
            live = self.inbox.get_nowait()
            self.outputs.add(live)
        for rid in list(self.live):
            live = self.live.pop(rid)
            try:  # give its blocks back if the core still can
                self.core.finish_request(rid, "error", str(error))
            except Exception:  # noqa: BLE001
                pass
            try:
                self.outputs.process([RequestOutput(rid, [], "error", str(error))])
            except Exception:  # noqa: BLE001 -- the sink itself is broken: say what we can
                live.sink(InternalError("the engine's step loop stopped",
                                        request_id=live.client_id).to_frame())
