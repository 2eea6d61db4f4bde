"""The in-process engine: Admission, the step loop around EngineCore, per-request streams.

    async with Engine(EngineConfig()) as engine:
        async for event in engine.generate(prompt="Hello", params={"max_tokens": 8}):
            ...  # Delta events, then one Done

Actors (DESIGN.md): `add_request` is Admission (`service.engine.admission`: checks,
then tokenizing in a thread pool; then the bounded queue); `service.engine.step_loop.StepLoop`
is the Scheduler + StepLoop actor around `EngineCore.step()`, which runs in a worker
thread; `service.engine.output_processor` turns each step's outputs into events.

Liveness: a fault of one request fails that request (EngineCore); if the loop itself
dies, every request in flight gets its error and Done, and `health()` (hence
/health) turns false with the reason, as it does while one step runs longer than
`EngineConfig.step_timeout_s`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from protocol import (ChatMessage, DuplicateId, InternalError, InvalidRequest, Overloaded,
                      ShuttingDown)
from service.core.config import EngineConfig
from service.core.engine_core import CoreStats, EngineCore
from service.core.kv_cache_manager import PreemptionCost
from service.core.request import Request
from service.engine.admission import Admission
from service.engine.client import EngineClient, EngineRequest
from service.engine.constraints.envelope_parser import tool_parser
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.faults import FaultPlan, FaultyPolicy, FaultyRunner
from service.engine.metrics import EngineMetrics
from service.engine.output_processor import LiveRequest
from service.engine.sampling_defaults import (SamplingDefaults, load_sampling_defaults,
                                              log_sampling_defaults)
from service.engine.step_loop import StepLoop
from service.engine.stream import Sink, with_prompt_token_ids
from service.worker.grammar_state import GrammarState

log = structlog.get_logger(__name__)


class Engine(EngineClient):
    """Continuous-batching engine usable from any asyncio application; an
    `service.engine.client.EngineClient` (what every front end is typed against).

    Args:
        config: engine settings (the same ones `conveyor serve` takes).
        loaded: an already loaded checkpoint to share (tests); None loads config.model.model.
        runner: a ready runner to use instead of loading a model (unit tests pass fakes):
            it meets `service.core.runner.Runner` and also has `tokenizer` (a
            transformers fast tokenizer), `vocab_size`, `eos_token_ids`, `model_name`.
    """

    def __init__(self, config: EngineConfig | None = None, *, loaded: Any = None,
                 runner: Any = None) -> None:
        self.config = config or EngineConfig()
        self._loaded = loaded
        self._runner = runner
        self._core: EngineCore | None = None
        self._loop: StepLoop | None = None
        self._admission: Admission | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._faults = FaultPlan()
        self.ready = False
        self.accepting = False
        self.metrics: EngineMetrics | None = None
        self._disk: Any = None  # service.worker.kv_disk_tier.DiskTier when --kv-disk-path
        self.sampling_defaults = SamplingDefaults()  # set from the model's generation config

    # ---- life cycle --------------------------------------------------------------
    async def start(self) -> Engine:
        """Load the model (in the worker thread) and start the step loop."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-step")
        loop = asyncio.get_running_loop()
        if self._runner is None:
            from service.worker.model_runner import ModelRunner

            self._runner = await loop.run_in_executor(
                self._executor, lambda: ModelRunner(self.config, self._loaded))
        runner = self._runner
        cost = None
        if hasattr(runner, "measure_rates"):
            swap_bw, prefill_rate = await loop.run_in_executor(self._executor,
                                                               runner.measure_rates)
            if swap_bw > 0:
                cost = PreemptionCost(runner.kv_bytes_per_block, swap_bw, prefill_rate)
            log.info("measured_rates", swap_gb_per_s=round(swap_bw / 1e9, 2),
                     prefill_tokens_per_s=round(prefill_rate))
        self._disk = None
        if self.config.cache.kv_disk_path is not None:
            self._disk = await loop.run_in_executor(self._executor, self._open_disk_tier)
        self._core = core = EngineCore(self.config, runner, cost=cost, disk=self._disk)
        self.metrics = EngineMetrics(runner.model_name)
        self.metrics.read_state_from(self._metrics_state)
        if self._disk is not None:
            self.metrics.read_disk_tier_from(self._disk)
        if hasattr(runner, "linear_layer_formats"):
            self.metrics.set_linear_layers(runner.linear_layer_formats())
        self.sampling_defaults = load_sampling_defaults(
            self.config.model.generation_config, self.config.model.model, runner.model_name)
        log_sampling_defaults(self.sampling_defaults)
        self._admission = admission = Admission(
            runner.tokenizer, runner.vocab_size, runner.max_model_len,
            core.scheduler.pool.num_blocks, self.config.cache.block_size,
            self.sampling_defaults, eos_token_ids=runner.eos_token_ids,
            max_pending=self.config.scheduler.max_waiting_requests,
            retry_after_ms=self._retry_after_ms)
        # Render the chat template once now: its first use compiles it (tens of ms that
        # would otherwise land on the first request's TTFT).
        try:
            await loop.run_in_executor(self._executor, lambda: admission.prompts(
                messages=[ChatMessage("user", "Hello")]))
        except InvalidRequest as e:  # a template that fails will say so to each request
            log.warning("chat_template_warmup_failed", error=str(e))
        self._loop = StepLoop(core, self._executor, self.metrics, self._faults)
        self._task = asyncio.create_task(self._loop.run(), name="conveyor-step-loop")
        self.ready = self.accepting = True
        describe = getattr(runner, "describe", dict)
        log.info("engine_ready", model=runner.model_name, kv_blocks=runner.num_blocks,
                 block_size=self.config.cache.block_size, **describe())
        return self

    async def close(self) -> None:
        """Cancel every request (each gets its Done), stop the loop, free the worker. Idempotent."""
        if self._closing:
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
            return
        self._closing = True
        self.ready = self.accepting = False
        if self._loop is not None:
            self._loop.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._disk is not None and self._executor is not None:
            # the blocks of the requests cancelled just now, then the queued writes
            loop = asyncio.get_running_loop()
            if self._core is not None:
                await loop.run_in_executor(self._executor, self._core.flush_disk_saves)
            await loop.run_in_executor(self._executor, self._disk.close)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._admission is not None:
            self._admission.close()
        release = getattr(self._runner, "release", None)
        if release is not None:
            release()  # the KV cache and weights go now, not at the next GC

    def _open_disk_tier(self) -> Any:
        """The disk KV tier over the runner's KV cache, or None (logged) when its directory
        cannot be used or the runner has no KV tensors (a fake runner)."""
        from service.worker.kv_disk_tier import open_disk_tier

        if not hasattr(self._runner, "kv_caches"):
            log.warning("kv_disk_tier_unavailable", reason="the runner has no KV cache tensors")
            return None
        try:
            return open_disk_tier(self.config, self._runner)
        except OSError as e:
            log.error("kv_disk_tier_unavailable", path=self.config.cache.kv_disk_path,
                      error=str(e))
            return None

    @property
    def disk_tier(self) -> Any:
        """The disk KV tier (`service.worker.kv_disk_tier.DiskTier`), None when off."""
        return self._disk

    def health(self) -> tuple[bool, str]:
        """(serving, why): False while loading or draining, when the step loop has died,
        or while one step has run longer than `config.step_timeout_s`."""
        loop = self._loop
        if loop is not None and loop.error is not None:
            return False, f"the step loop died: {type(loop.error).__name__}: {loop.error}"
        if self._task is not None and self._task.done() and not self._closing:
            return False, "the step loop has stopped"
        if not self.ready:
            return False, "loading" if not self._closing else "closed"
        if not self.accepting:
            return False, "draining"
        started = loop.step_started if loop is not None else None
        if started is not None:
            running = time.monotonic() - started
            if running > self.config.step_timeout_s:
                return False, f"stalled: one step has run for {running:.0f} s"
        return True, "ok"

    async def metrics_text(self) -> bytes:
        """The Prometheus text of this engine's metrics (what /metrics serves)."""
        return self.metrics.render() if self.metrics is not None else b""

    def inject_fault(self, where: str = "execute", request_id: str | None = None,
                     count: int | None = 1) -> None:
        """Test-only: make a real step fail (see `service.engine.faults`): where "schedule",
        "execute" (the forward, in the worker thread) or "output"; for `request_id`
        (engine key or client id) or, None, any; `count` times (None: always)."""
        self._faults.arm(where, request_id, count)
        core = self.core
        if not isinstance(core.runner, FaultyRunner):  # armed once: no cost until then
            core.runner = FaultyRunner(core.runner, self._faults)
            core.scheduler.policy = FaultyPolicy(core.scheduler.policy, self._faults)

    def stats(self) -> CoreStats | None:
        """Requests running and waiting (the admission inbox included), KV usage (0..1),
        prefix-cache and preemption counters, as /metrics shows them; None before start()."""
        return self._metrics_state()

    def _metrics_state(self) -> CoreStats | None:
        """What the gauges show at scrape time (waiting includes the admission inbox)."""
        if self._core is None:
            return None
        s = self._core.stats()
        inbox = self._loop.inbox.qsize() if self._loop is not None else 0
        return s._replace(waiting=s.waiting + inbox)

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- facts -------------------------------------------------------------------
    @property
    def runner(self) -> Any:
        assert self._runner is not None, "Engine.start() has not run"
        return self._runner

    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "Engine.start() has not run"
        return self._core

    @property
    def scheduler(self):
        """The core's scheduler (tests and benchmarks inspect it)."""
        return self.core.scheduler

    @property
    def num_steps(self) -> int:
        return self._core.num_steps if self._core is not None else 0

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds (blocks x block_size): no request spans more."""
        return self.core.scheduler.pool.num_blocks * self.config.cache.block_size

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def num_unfinished(self) -> int:
        """Requests admitted whose Done has not been sent yet."""
        return len(self._loop.live) if self._loop is not None else 0

    # ---- admission ---------------------------------------------------------------
    async def add_request(self, request: EngineRequest, sink: Sink) -> int:
        """Validate, tokenize and queue one request (Admission); return its prompt length
        in tokens. Every event of the request is passed to `sink` (never awaited).

        Cheap checks run first, on the event loop: the params, the prompt's shape, and a
        lower bound on its length from its character count, so a prompt that cannot fit
        is refused before it is tokenized. Chat templating and tokenizing then run in a
        small thread pool (`service.engine.admission.Admission`); token ids need none.

        Raises InvalidRequest, ContextLengthExceeded, DuplicateId, Overloaded (queue or
        preprocessing pool full), ShuttingDown, InternalError (the step loop has died).
        Nothing is queued when it raises.
        """
        request = request.resolved()
        key, client_id = request.request_id, request.client_id
        assert key is not None and client_id is not None and request.arrival_time is not None
        self._check_accepting(key, client_id)
        assert self._admission is not None and self._loop is not None, \
            "Engine.start() has not run"
        ids, params, matcher, tool_format = await self._admission.prepare_full(request)
        # Again: the engine may have begun shutting down, or the id been taken, meanwhile.
        self._check_accepting(key, client_id)
        limit = self.config.scheduler.max_waiting_requests
        if self.num_waiting >= limit:
            raise Overloaded(f"the admission queue is full ({limit} requests waiting)",
                             retry_after_ms=self._retry_after_ms(), request_id=client_id)
        runner = self.runner
        req = Request(key, ids, params, runner.eos_token_ids, arrival_time=request.arrival_time)
        if matcher is not None:  # structured output / tools: masks follow its output tokens
            req.constraint = GrammarState(matcher, req.output_token_ids)
        detok = IncrementalDetokenizer(runner.tokenizer, ids, stop=params.stop,
                                       min_tokens=params.min_tokens)
        if request.return_prompt_token_ids:
            sink = with_prompt_token_ids(sink, ids)
        self._loop.submit(LiveRequest(req, client_id, request.connection_id, sink, detok,
                                      tool_parser(tool_format) if tool_format else None))
        return len(ids)

    def _check_accepting(self, request_id: str, client_id: str) -> None:
        loop = self._loop
        if loop is not None and loop.error is not None:
            raise InternalError("the engine's step loop has stopped; see the server log",
                                request_id=client_id)
        if not self.accepting:
            raise ShuttingDown("the engine is not accepting requests", request_id=client_id)
        if loop is not None and request_id in loop.live:
            raise DuplicateId(f"request id {client_id!r} is already in flight",
                              param="$.id", request_id=client_id)

    @property
    def num_waiting(self) -> int:
        """Requests admitted but never scheduled yet (the admission queue's length)."""
        inbox = self._loop.inbox.qsize() if self._loop is not None else 0
        return inbox + self.core.num_waiting_new

    def _retry_after_ms(self) -> int:
        """When a slot in the admission queue is likely: the queue drains at about one
        batch of max_num_seqs requests per mean request duration seen so far."""
        mean = self._loop.outputs.mean_e2e_s if self._loop is not None else None
        batches = self.num_waiting / self.config.scheduler.max_num_seqs
        return int(min(60_000, max(100, 1000 * (mean or 1.0) * max(batches, 1.0) / 4)))

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (its Done says "cancelled"); unknown ids are ignored."""
        if self._loop is not None:
            self._loop.abort(request_id)
