"""Output processing: EngineCore's token outputs -> each request's Delta / Error / Done events.

Runs on the event loop between steps (vLLM v1 splits its output processor from
EngineCore the same way). Per request it detokenizes incrementally (stop strings
found here end the request in the core), stamps TTFT / ITL metrics, and builds
the `done` with usage and timings. A failure while processing one request's
output fails that request alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
from msgspec import UNSET

from protocol import Delta, Done, InternalError, Timings, Usage
from service.core.engine_core import EngineCore, RequestOutput
from service.core.request import Request
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.metrics import EngineMetrics
from service.engine.stream import Sink

if TYPE_CHECKING:
    from service.engine.constraints.envelope_parser import EnvelopeParser
    from service.engine.constraints.tool_parser import ToolCallParser

log = structlog.get_logger("service.engine")

__all__ = ["LiveRequest", "OutputProcessor"]


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


class LiveRequest:
    """Front-side state of one request between admission and its Done."""

    __slots__ = ("req", "client_id", "connection_id", "sink", "detok", "sent_tokens",
                 "last_emit", "stop_string_hit", "tools")

    def __init__(self, req: Request, client_id: str, connection_id: str | None, sink: Sink,
                 detok: IncrementalDetokenizer,
                 tools: ToolCallParser | EnvelopeParser | None = None) -> None:
        self.req = req
        self.client_id = client_id
        self.connection_id = connection_id
        self.sink = sink
        self.detok = detok
        self.sent_tokens = 0  # token ids delivered so far (the next Delta's index)
        self.last_emit: float | None = None
        self.stop_string_hit = False
        self.tools = tools  # a request with tools: its text -> tool-call pieces


class OutputProcessor:
    """Turns RequestOutputs into events for the requests in `live` (request id -> state).

    Args:
        core: the EngineCore whose outputs these are (stop strings finish requests there).
        metrics: Prometheus metrics, or None.
    """

    def __init__(self, core: EngineCore, metrics: EngineMetrics | None) -> None:
        self.core = core
        self.metrics = metrics
        self.live: dict[str, LiveRequest] = {}
        self.mean_e2e_s: float | None = None

    def add(self, live: LiveRequest) -> None:
        self.live[live.req.request_id] = live

    def process(self, outputs: Iterable[RequestOutput]) -> None:
        """Send every output's events; never raises for one request's fault."""
        pending = list(outputs)
        while pending:
            out = pending.pop(0)
            live = self.live.get(out.request_id)
            if live is None:
                continue
            try:
                pending += self._process_one(out, live)
            except Exception as e:  # noqa: BLE001 -- this request's fault only
                log.exception("output_processing_failed", request_id=live.client_id)
                ended = self.core.finish_request(out.request_id, "error",
                                                 f"{type(e).__name__}: {e}")
                if not ended:  # already finished in the core: end it here
                    ended = [RequestOutput(out.request_id, [], "error", str(e))]
                pending += ended

    def _process_one(self, out: RequestOutput, live: LiveRequest) -> list[RequestOutput]:
        """Events of one output; returns outputs that ending the request produced."""
        more: list[RequestOutput] = []
        reason = out.finish_reason
        text = ""
        if out.new_token_ids:
            self._observe_tokens(live, len(out.new_token_ids))
            text, stop_hit = live.detok.step(out.new_token_ids)
            if stop_hit is not None:
                live.stop_string_hit = True
                if reason is None:
                    more = self.core.finish_request(out.request_id, "stop")
        if reason == "length" and live.stop_string_hit:
            reason = "stop"  # the stop string came with the last token allowed
        if reason is not None and reason != "error":
            text += live.detok.flush()
        calls = None
        if live.tools is not None:  # the text of calls goes out as tool_calls pieces
            text, calls = live.tools.feed(text)
            if reason is not None and reason != "error":
                more_text, last = live.tools.finish()
                text, calls = text + more_text, calls + last
                if reason == "stop" and live.tools.calls and not live.tools.partial:
                    reason = "tool_calls"
        if out.new_token_ids or text or calls or out.prompt_logprobs is not None:
            live.sink(Delta(id=live.client_id, index=live.sent_tokens, text=text,
                            token_ids=list(out.new_token_ids), logprobs=out.logprobs,
                            prompt_logprobs=out.prompt_logprobs,
                            prompt_token_ids=None if out.prompt_logprobs is None
                            else list(live.req.prompt_token_ids), tool_calls=calls or None))
            live.sent_tokens += len(out.new_token_ids)
        if reason is not None:
            self._done(live, reason, out.error)
        return more

    def _observe_tokens(self, live: LiveRequest, n: int) -> None:
        m = self.metrics
        now = time.monotonic()
        if m is not None:
            if live.last_emit is None:
                m.ttft.observe(now - live.req.arrival_time)
            else:
                m.itl.observe(now - live.last_emit)
            m.generation_tokens.inc(n)
        live.last_emit = now

    def _done(self, live: LiveRequest, reason: str, error: str | None) -> None:
        """Send the request's one Done (after an `error` frame when it failed)."""
        self.live.pop(live.req.request_id, None)
        req = live.req
        if reason == "error":
            log.warning("request_failed", request_id=live.client_id, error=error)
            live.sink(InternalError("the engine failed while running this request's step",
                                    request_id=live.client_id).to_frame())
        n_out = len(req.output_token_ids)
        end = time.monotonic()
        e2e = end - req.arrival_time
        self.mean_e2e_s = e2e if self.mean_e2e_s is None else 0.9 * self.mean_e2e_s + 0.1 * e2e
        tpot = None
        if n_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
            tpot = round((req.last_token_time - req.first_token_time) * 1000.0 / (n_out - 1), 3)
        usage = Usage(prompt_tokens=req.num_prompt_tokens, completion_tokens=n_out,
                      total_tokens=req.num_prompt_tokens + n_out,
                      cached_tokens=max(0, req.num_cached_tokens),
                      disk_cached_tokens=req.num_disk_cached_tokens
                      if self.core.disk is not None else UNSET)
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
        if live.tools is not None and live.tools.calls:
            done.tool_calls = list(live.tools.calls)
        live.sink(done)
