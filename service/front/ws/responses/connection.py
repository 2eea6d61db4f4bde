"""The actor of one `/v1/responses` socket (the OpenAI Responses API's WebSocket mode).

Frames in: `response.create` (protocol/responses_request.py). Events out: the Responses
streaming events of each response (service/front/ws/responses/run.py), through the socket's
bounded outbox; the life cycle, slow-reader handling and close codes are
`SocketActor`'s, the same as `/v1/stream`'s.

- One response in flight per lane: a create without `stream_id` uses the default lane.
  A second create on a busy lane gets the error `conversation_already_has_active_response`
  and the response in flight goes on. At most `max_requests_per_connection` lanes are
  busy at once (`too_many_requests` beyond).
- `previous_response_id` continues a completed response of this connection from its
  stored context (service/front/ws/responses/store.py, bounded by `responses_max_stored` and
  `responses_max_stored_tokens`); an unknown id gets `previous_response_not_found`.
- `generate: false` (warm-up) prefills the context into the prefix cache: the engine
  runs the prompt with max_tokens=1 and the one sampled token is dropped; the response
  completes with no output and can be continued.
- An unset `max_output_tokens` is left to the engine's admission, as an unset
  `max_tokens` is on every route: the model's generation config `max_new_tokens` capped
  by what the context (or a smaller whole KV cache) leaves after the input, else 256.
- Closing the socket cancels the responses in flight; the engine frees their KV blocks
  before its next step. Errors never close the socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from protocol import Done, ProtocolError
from protocol.responses_request import CreateRequest, ResponsesError, parse_client_frame
from service.front.refusals import log_refused
from service.front.ws.actor import SocketActor
from service.front.ws.responses.admit import (admit, check_model, context_of,
                                              from_protocol_error)
from service.front.ws.responses.run import ResponseRun, new_response_id
from service.front.ws.responses.store import ResponseStore

log = structlog.get_logger(__name__)

__all__ = ["BUSY_CODE", "ResponsesConnection", "from_protocol_error"]

BUSY_CODE = "conversation_already_has_active_response"
"""The error code of a create sent while the lane's response is in flight (the code
OpenAI's Realtime API documents for the same situation)."""


class ResponsesConnection(SocketActor):
    """Serves one `/v1/responses` socket until it closes."""

    route = "/v1/responses"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.store = ResponseStore(self.config.responses_max_stored,
                                   self.config.responses_max_stored_tokens)
        self.runs: dict[str | None, ResponseRun] = {}  # lane (stream_id) -> its response
        self._admitting: dict[str | None, asyncio.Task[None]] = {}
        self._special_ids = frozenset(self.engine.tokenizer.all_special_ids)

    def _key(self, response_id: str) -> str:
        return f"{self.conn_id}/{response_id}"

    @property
    def num_requests(self) -> int:
        return len(self.runs)

    def _pending_tasks(self) -> Iterable[asyncio.Task[None]]:
        return self._admitting.values()

    def abort_all(self) -> None:
        for task in self._admitting.values():
            task.cancel()
        for run in list(self.runs.values()):
            self.engine.abort(self._key(run.id))

    def _on_frame(self, frame: str | bytes, received: float) -> None:
        stream_id = None
        try:
            req = parse_client_frame(frame)
            stream_id = req.stream_id
            self._create(req, received)
        except ResponsesError as e:
            log_refused("/v1/responses", e.code, None, status=e.status, param=e.param,
                        message=e.message, connection_id=self.conn_id)
            self.outbox.put(e.event(0, stream_id if stream_id is not None else e.stream_id))
        except Exception:
            log.exception("frame_failed", connection_id=self.conn_id)
            self.outbox.put(ResponsesError("the server failed to handle this event",
                                           code="server_error", status=500,
                                           type="server_error").event(0, stream_id))

    def _create(self, req: CreateRequest, received: float) -> None:
        """Checks that need no engine work, then admission in a task of its own."""
        lane = req.stream_id
        if lane in self.runs:
            raise ResponsesError(
                f"Conversation already has an active response in progress: "
                f"{self.runs[lane].id}. Wait until the response is finished before creating "
                f"a new one.", code=BUSY_CODE)
        if len(self.runs) >= self.config.max_requests_per_connection:
            raise ResponsesError(
                f"this connection already has {len(self.runs)} responses in flight (limit "
                f"{self.config.max_requests_per_connection})", code="too_many_requests",
                status=429, type="rate_limit_error")
        model = self.engine.model_name
        check_model(req, model)
        previous = None
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise ResponsesError(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    code="previous_response_not_found", param="previous_response_id")
        defaults = self.engine.sampling_defaults
        run = ResponseRun(new_response_id(), req, model,
                          temperature=req.temperature if req.temperature is not None
                          else defaults.temperature,
                          top_p=req.top_p if req.top_p is not None else defaults.top_p,
                          put=self.outbox.put, on_finish=self._finished)
        self.runs[lane] = run  # reserved: a second create on this lane is refused
        self._admitting[lane] = asyncio.get_running_loop().create_task(
            self._admit(run, previous, received), name=f"{self.conn_id}-admit")

    async def _admit(self, run: ResponseRun, previous, received: float) -> None:
        req, lane = run.request, run.request.stream_id
        try:
            await admit(self.engine, run, previous, request_id=self._key(run.id),
                        connection_id=self.conn_id, received=received)
        except ProtocolError as e:
            self.runs.pop(lane, None)
            refusal = from_protocol_error(e, req)
            log_refused("/v1/responses", refusal.code, run.id, status=refusal.status,
                        param=refusal.param, message=refusal.message,
                        connection_id=self.conn_id)
            self.outbox.put(refusal.event(0, lane))
            return
        except asyncio.CancelledError:
            self.runs.pop(lane, None)
            raise
        except Exception:
            self.runs.pop(lane, None)
            log.exception("admission_failed", connection_id=self.conn_id, request_id=run.id)
            self.outbox.put(ResponsesError("the server failed to admit this response",
                                           code="server_error", status=500,
                                           type="server_error").event(0, lane))
            return
        finally:
            self._admitting.pop(lane, None)
        # Queued: the engine's events for it come from later steps, after these.
        run.start()
        if self._closed:
            self.engine.abort(self._key(run.id))

    def _finished(self, run: ResponseRun, done: Done) -> None:
        """The engine's Done for `run` (its last event is sent): free the lane and keep its
        context for `previous_response_id`."""
        if self.runs.get(run.request.stream_id) is run:
            del self.runs[run.request.stream_id]
        context = context_of(run, done, self._special_ids)
        if context is not None:
            self.store.put(context, store=run.request.store)
