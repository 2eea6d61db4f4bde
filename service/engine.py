"""The in-process engine: admission, the scheduler/step loop, and per-request streams.

    async with Engine(EngineConfig()) as engine:
        async for event in engine.generate(prompt="Hello", params=SamplingParams(max_tokens=8)):
            ...  # Delta events, then one Done

Actors (DESIGN.md): `add_request` is Admission (tokenize, validate, bounded queue);
`_step_loop` is the Scheduler + StepLoop actor: before every step it admits new
requests, applies cancels, asks the scheduler for a batch, runs the forward in a
dedicated worker thread (so the event loop keeps streaming meanwhile), and turns
the sampled tokens into events for each request's sink.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import structlog

from protocol import (ChatMessage, ContextLengthExceeded, Delta, Done, DuplicateId, Error,
                      InternalError, InvalidRequest, Overloaded, SamplingParams, ShuttingDown,
                      Timings, Usage)
from service.block_pool import KVBlockPool
from service.config import EngineConfig
from service.detokenizer import IncrementalDetokenizer
from service.loader import LoadedModel
from service.metrics import EngineMetrics, EngineState
from service.model_runner import ModelRunner
from service.request import Request
from service.request_stream import Event, RequestStream, Sink
from service.scheduler import PreemptionCost, Scheduler
from service.scheduler_output import SchedulerOutput
from service.swap_space import SwapSpace
from service.request_input import coerce_messages, coerce_params, coerce_token_ids
from service.tokenize_prompt import PromptTokenizer

log = structlog.get_logger(__name__)


class _Live:
    """Engine-side bookkeeping of one request between admission and its Done."""

    __slots__ = ("req", "client_id", "connection_id", "sink", "detok")

    def __init__(self, req: Request, client_id: str, connection_id: str | None, sink: Sink,
                 detok: IncrementalDetokenizer) -> None:
        self.req = req
        self.client_id = client_id
        self.connection_id = connection_id
        self.sink = sink
        self.detok = detok


def _injected_fault(out: SchedulerOutput) -> dict[str, int]:
    raise RuntimeError("injected step fault (Engine.inject_fault, test-only)")


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


class Engine:
    """Continuous-batching engine usable from any asyncio application.

    Args:
        config: engine settings (the same ones `conveyor serve` takes).
        loaded: an already loaded checkpoint to share (tests); None loads config.model.model.
    """

    def __init__(self, config: EngineConfig | None = None, *,
                 loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self._loaded = loaded
        self._runner: ModelRunner | None = None
        self._scheduler: Scheduler | None = None
        self._executor: ThreadPoolExecutor | None = None
        # Chat templating and tokenizing: off the event loop, a few threads, bounded.
        self._preprocess_pool = ThreadPoolExecutor(2, thread_name_prefix="conveyor-prompt")
        self._preprocessing = 0
        self._prompts: PromptTokenizer | None = None
        self._task: asyncio.Task | None = None
        self._inbox: asyncio.Queue[_Live] = asyncio.Queue()
        self._aborts: set[str] = set()
        self._live: dict[str, _Live] = {}
        self._wakeup = asyncio.Event()
        self._closing = False
        self.ready = False
        self.accepting = False
        self.num_steps = 0
        self._mean_e2e_s: float | None = None
        self._fault_steps = 0
        self.metrics: EngineMetrics | None = None
        self._held: list[tuple[Sink, Done]] = []  # static/dynamic batching: dones of the batch

    # ---- life cycle --------------------------------------------------------------
    async def start(self) -> Engine:
        """Load the model (in the worker thread) and start the step loop."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-step")
        loop = asyncio.get_running_loop()
        self._runner = await loop.run_in_executor(
            self._executor, lambda: ModelRunner(self.config, self._loaded))
        runner = self._runner
        swap_bw, prefill_rate = await loop.run_in_executor(self._executor, runner.measure_rates)
        cost = PreemptionCost(runner.kv_bytes_per_block, swap_bw, prefill_rate) \
            if swap_bw > 0 else None
        log.info("measured_rates", swap_gb_per_s=round(swap_bw / 1e9, 2),
                 prefill_tokens_per_s=round(prefill_rate))
        pool = KVBlockPool(runner.num_blocks, self.config.cache.block_size,
                           self.config.cache.enable_prefix_caching)
        self._scheduler = Scheduler(self.config.scheduler, pool, runner.max_model_len,
                                    cache=self.config.cache,
                                    swap=SwapSpace(runner.num_swap_blocks), cost=cost)
        self._prompts = PromptTokenizer(runner.tokenizer, runner.model.vocab_size)
        self.metrics = EngineMetrics(runner.loaded.name)
        self.metrics.read_state_from(self._metrics_state)
        self._task = asyncio.create_task(self._step_loop(), name="conveyor-step-loop")
        self.ready = self.accepting = True
        log.info("engine_ready", model=runner.loaded.name, kv_blocks=runner.num_blocks,
                 block_size=self.config.cache.block_size, device=str(runner.device),
                 kernels=runner.ops.name, dtype=self.config.model.dtype,
                 quantization=self.config.model.quantization or "none",
                 decode_kernel=runner.decode_kernel)
        return self

    async def close(self) -> None:
        """Cancel every request (each gets its Done), stop the loop, free the worker. Idempotent."""
        if self._closing:
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
            return
        self._closing = True
        self.ready = self.accepting = False
        self._aborts.update(self._live)
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        if self._runner is not None:
            self._runner.release()  # the KV cache and weights go now, not at the next GC

    def begin_shutdown(self) -> None:
        """Stop accepting requests (new ones get ShuttingDown); running ones go on."""
        self.accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._live:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def inject_fault(self, steps: int = 1) -> None:
        """Test-only: make the next `steps` forward passes raise inside the worker thread,
        as a real kernel or runtime failure would."""
        self._fault_steps += steps

    def stats(self) -> EngineState | None:
        """Running and waiting requests, KV usage (0..1), prefix-cache and preemption
        counters, as /metrics shows them; None before start()."""
        return self._metrics_state()

    def _metrics_state(self) -> EngineState | None:
        if self._scheduler is None:
            return None
        sched = self._scheduler
        stats = sched.pool.stats
        return EngineState(running=len(sched.running), waiting=len(sched.waiting) +
                           self._inbox.qsize(), kv_usage=sched.pool.usage,
                           prefix_queries=stats.prefix_cache_queries,
                           prefix_hits=stats.prefix_cache_hits,
                           preemptions=sched.num_preemptions)

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- facts -------------------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        assert self._runner is not None, "Engine.start() has not run"
        return self._runner

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "Engine.start() has not run"
        return self._scheduler

    @property
    def model_name(self) -> str:
        return self.runner.loaded.name

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def prompt_tokenizer(self) -> PromptTokenizer:
        """Admission's prompt -> token ids (chat template, checks); other front ends that
        tokenize before they hand ids over (the cluster ingress) use the same one."""
        assert self._prompts is not None, "Engine.start() has not run"
        return self._prompts

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    # ---- admission ---------------------------------------------------------------
    async def add_request(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
                          prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                          params: SamplingParams | Mapping[str, Any] | None = None,
                          request_id: str | None = None, client_id: str | None = None,
                          sink: Sink | None = None, arrival_time: float | None = None,
                          connection_id: str | None = None) -> RequestStream | int:
        """Validate, tokenize and queue one request (Admission).

        messages: chat turns, `ChatMessage`s or `{"role", "content"}` dicts; prompt: raw
        text; prompt_token_ids: ids; exactly one of the three. params: `SamplingParams` or
        a mapping of its fields; checked exactly as the wire checks `$.params`.
        request_id: engine-wide unique key (default: a fresh uuid); client_id: the id
        written into its events (default: request_id). With `sink`, events are passed to
        it (never awaited) and the prompt length in tokens is returned; without, a
        RequestStream to iterate is returned. arrival_time: `time.monotonic()` of receipt.
        connection_id: logged with every line about the request.

        Cheap checks run first, on the event loop: the params, the prompt's shape, and a
        lower bound on its length from its character count, so a prompt that cannot fit
        is refused before it is tokenized. Chat templating and tokenizing then run in a
        small thread pool, never on the event loop (as vLLM's and SGLang's front ends
        do), so a huge prompt never stalls other clients' streams.

        Raises InvalidRequest, ContextLengthExceeded, DuplicateId, Overloaded (queue or
        preprocessing pool full), ShuttingDown. Nothing is queued when it raises.
        """
        request_id = request_id or uuid.uuid4().hex
        client_id = client_id or request_id
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._check_accepting(request_id, client_id)
        params = coerce_params(params, request_id=client_id)
        if messages is not None:
            messages = coerce_messages(messages, request_id=client_id)
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}",
                                 param="$.prompt", request_id=client_id)
        if prompt_token_ids is not None:
            prompt_token_ids = coerce_token_ids(prompt_token_ids, request_id=client_id)
        prompts = self._prompts
        assert prompts is not None, "Engine.start() has not run"
        prompts.check_fits(prompts.min_tokens(messages=messages, prompt=prompt,
                                              token_ids=prompt_token_ids),
                           params.max_tokens, self.max_model_len, client_id)
        if self._preprocessing >= self.config.scheduler.max_waiting_requests:
            raise Overloaded("too many prompts are being tokenized", request_id=client_id,
                             retry_after_ms=self._retry_after_ms())
        tokenize = functools.partial(prompts, messages=messages, prompt=prompt,
                                     token_ids=prompt_token_ids, request_id=client_id)
        if prompt_token_ids is not None:
            ids = tokenize()  # nothing to tokenize: a range check, at once
        else:
            self._preprocessing += 1
            try:
                ids = await asyncio.get_running_loop().run_in_executor(self._preprocess_pool,
                                                                       tokenize)
            finally:
                self._preprocessing -= 1
        # The checks again: the engine may have begun shutting down, or the id been taken,
        # while the prompt was tokenized.
        self._check_accepting(request_id, client_id)
        self._check_fits(len(ids), params, client_id)
        runner = self.runner
        req = Request(request_id, ids, params, runner.loaded.eos_token_ids, arrival_time=arrival)
        stream = None
        if sink is None:
            stream = RequestStream(client_id, len(ids))
            sink = stream.put
        limit = self.config.scheduler.max_waiting_requests
        if self.num_waiting >= limit:
            raise Overloaded(f"the admission queue is full ({limit} requests waiting)",
                             retry_after_ms=self._retry_after_ms(), request_id=client_id)
        detok = IncrementalDetokenizer(runner.tokenizer, ids, stop=params.stop)
        live = _Live(req, client_id, connection_id, sink, detok)
        self._inbox.put_nowait(live)
        self._live[request_id] = live
        self._wakeup.set()
        return stream if stream is not None else len(ids)

    def _check_accepting(self, request_id: str, client_id: str) -> None:
        if not self.accepting:
            raise ShuttingDown("the engine is not accepting requests", request_id=client_id)
        if request_id in self._live:
            raise DuplicateId(f"request id {client_id!r} is already in flight",
                              param="$.id", request_id=client_id)

    @property
    def num_waiting(self) -> int:
        """Requests admitted but never scheduled yet (the admission queue's length)."""
        return self._inbox.qsize() + self.scheduler.num_waiting_new

    def _retry_after_ms(self) -> int:
        """When a slot in the admission queue is likely: the queue drains at about one
        batch of max_num_seqs requests per mean request duration seen so far."""
        per_request_s = self._mean_e2e_s or 1.0
        batches = self.num_waiting / self.config.scheduler.max_num_seqs
        return int(min(60_000, max(100, 1000 * per_request_s * max(batches, 1.0) / 4)))

    def _check_fits(self, n: int, params: SamplingParams, client_id: str) -> None:
        limit = self.max_model_len
        if n + params.max_tokens > limit:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"({limit})", param="$.params.max_tokens", request_id=client_id)
        pool = self.scheduler.pool
        need = pool.blocks_needed(n + params.max_tokens)
        if need > pool.num_blocks:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
                f"but the whole cache has {pool.num_blocks}", param="$.params.max_tokens",
                request_id=client_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (its Done says "cancelled"); unknown ids are ignored."""
        if request_id in self._live:
            self._aborts.add(request_id)
            self._wakeup.set()

    async def generate(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
                       prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                       params: SamplingParams | Mapping[str, Any] | None = None,
                       request_id: str | None = None) -> AsyncIterator[Event]:
        """Deltas of one request, then its Done (usage and timings).

        Breaking out of the iteration aborts the request. Raises what add_request raises.
        """
        stream = await self.add_request(messages=messages, prompt=prompt,
                                        prompt_token_ids=prompt_token_ids, params=params,
                                        request_id=request_id)
        assert isinstance(stream, RequestStream)
        key = request_id or stream.request_id
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.finished:
                self.abort(key)

    # ---- the step loop --------------------------------------------------------------
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            self._admit()
            self._apply_aborts()
            if not sched.has_unfinished():
                if self._closing:
                    return
                sched.check_integrity()
                self._wakeup.clear()
                if self._inbox.empty() and not self._aborts:
                    await self._wakeup.wait()
                continue
            out = sched.schedule()
            if out.is_empty:
                # nothing can run before new input, or before a dynamic batch is due
                due = sched.idle_until()
                timeout = None if due is None else max(0.0, due - time.monotonic())
                if due is None and not sched.running:
                    log.warning("empty_step", waiting=len(sched.waiting))
                    timeout = 0.005
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            execute = self.runner.execute
            if self._fault_steps > 0:
                self._fault_steps -= 1
                execute = _injected_fault
            try:
                sampled = await loop.run_in_executor(self._executor, execute, out)
            except Exception:
                log.exception("step_failed", requests=[s.request_id for s in out.sequences])
                self._fail_step(out)
                continue
            self.num_steps += 1
            if self.metrics is not None:
                self.metrics.iteration_tokens.observe(out.num_batched_tokens)
            for req in sched.update_from_output(out, sampled):
                self._emit_token(req)
            self._release_held()

    def _admit(self) -> None:
        while not self._inbox.empty():
            live = self._inbox.get_nowait()
            self.scheduler.add_request(live.req)

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        for rid in list(self._aborts):
            self._finish(rid, "cancelled")
        self._aborts.clear()
        self._release_held()

    def _emit_token(self, req: Request) -> None:
        live = self._live[req.request_id]
        now = time.monotonic()
        m = self.metrics
        if req.first_token_time is None:
            req.first_token_time = now
            if m is not None:
                m.ttft.observe(now - req.arrival_time)
        elif m is not None and req.last_token_time is not None:
            m.itl.observe(now - req.last_token_time)
        if m is not None:
            m.generation_tokens.inc()
        req.last_token_time = now
        token = req.output_token_ids[-1]
        reason = req.check_stop(self.max_model_len)
        text, stop_hit = live.detok.step([token])
        if stop_hit is not None:
            reason = "stop"
        elif reason is not None:
            text += live.detok.flush()
        live.sink(Delta(id=live.client_id, index=len(req.output_token_ids) - 1, text=text,
                        token_ids=[token]))
        if reason is not None:
            self._finish(req.request_id, reason)

    def _fail_step(self, out: SchedulerOutput) -> None:
        for seq in out.sequences:
            live = self._live.get(seq.request_id)
            if live is None:
                continue
            live.sink(InternalError("the engine failed while running this request's step",
                                    request_id=live.client_id).to_frame())
            self._finish(seq.request_id, "error")

    def _finish(self, request_id: str, reason: str) -> None:
        """Remove the request everywhere and send its one Done."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.scheduler.finish_request(request_id, reason)
        req = live.req
        req.finish_reason = reason
        n_out = len(req.output_token_ids)
        end = time.monotonic()
        e2e = end - req.arrival_time
        self._mean_e2e_s = e2e if self._mean_e2e_s is None else 0.9 * self._mean_e2e_s + 0.1 * e2e
        tpot = None
        if n_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
            tpot = round((req.last_token_time - req.first_token_time) * 1000.0 / (n_out - 1), 3)
        usage = Usage(prompt_tokens=req.num_prompt_tokens, completion_tokens=n_out,
                      total_tokens=req.num_prompt_tokens + n_out,
                      cached_tokens=max(0, req.num_cached_tokens))
        timings = Timings(queue_ms=_ms(req.arrival_time, req.first_scheduled_time),
                          ttft_ms=_ms(req.arrival_time, req.first_token_time),
                          tpot_ms=tpot, e2e_ms=_ms(req.arrival_time, end),
                          preemptions=req.num_preemptions)
        if self.metrics is not None:
            queue_s = None if req.first_scheduled_time is None \
                else req.first_scheduled_time - req.arrival_time
            self.metrics.request_finished(reason, req.num_prompt_tokens, e2e, queue_s)
        log.info("request_finished", request_id=live.client_id,
                 connection_id=live.connection_id, finish_reason=reason,
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 cached_tokens=usage.cached_tokens, queue_ms=timings.queue_ms,
                 ttft_ms=timings.ttft_ms, tpot_ms=timings.tpot_ms, e2e_ms=timings.e2e_ms,
                 preemptions=timings.preemptions)
        done = Done(id=live.client_id, finish_reason=reason,  # type: ignore[arg-type]
                    usage=usage, timings=timings)
        if reason in ("stop", "length") and self.scheduler.batch_in_flight:
            self._held.append((live.sink, done))  # static batching: sent when the batch ends
        else:
            live.sink(done)

    def _release_held(self) -> None:
        """Static/dynamic batching: send the batch's dones once all its members finished."""
        if self._held and not self.scheduler.batch_in_flight:
            held, self._held = self._held, []
            for sink, done in held:
                sink(done)
