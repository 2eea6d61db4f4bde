"""One response in flight: the engine's Delta / Error / Done for it, as Responses events.

`ResponseRun.start()` sends the opening events once the engine queued the request;
`on_event` is the request's engine sink (called on the event loop, never blocks).
Each event gets the next `sequence_number` of this response, counted from 0, when the
connection's outbox queues it: a delta that merged into a waiting delta (a slow reader)
takes no number, so the numbers the client sees stay 0, 1, 2, ... without gaps.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from msgspec import Struct

from protocol import ChatMessage, Delta, Done, Error, Usage
from protocol.responses import (ContentPartAdded, ContentPartDone, ErrorDetail, ErrorEvent,
                                IncompleteDetails, InputTokensDetails, OutputItemAdded,
                                OutputItemDone, OutputMessage, OutputText, OutputTextDelta,
                                OutputTextDone, OutputTokensDetails, Response,
                                ResponseCompleted, ResponseCreated, ResponseFailed,
                                ResponseFailure, ResponseIncomplete, ResponseInProgress,
                                ResponseUsage, TextConfig, TextFormat)
from protocol.responses_request import CreateRequest

__all__ = ["ResponseRun", "new_response_id"]


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _usage(u: Usage, output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=u.cached_tokens,
            cache_write_tokens=max(0, u.prompt_tokens - u.cached_tokens)),
        output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(),
        total_tokens=u.prompt_tokens + output_tokens)


class ResponseRun:
    """The events of one response.

    Args:
        response_id: "resp_..."; request: the checked create; model: the served model name.
        temperature, top_p: the values it is sampled with (shown in the Response object).
        put: the connection's outbox `put` (True when the frame was queued on its own).
        on_finish: called once with this run and the engine's Done, after the last event.
    """

    def __init__(self, response_id: str, request: CreateRequest, model: str, *,
                 temperature: float | None, top_p: float | None,
                 put: Callable[[Struct], bool],
                 on_finish: Callable[[ResponseRun, Done], None]) -> None:
        self.id = response_id
        self.request = request
        self.model = model
        self.temperature, self.top_p = temperature, top_p
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = time.time()
        self.seq = 0
        self.text: list[str] = []
        self.output_ids: list[int] = []
        self.error: Error | None = None
        self.finished = False
        self.prompt_ids: list[int] = []  # set when admitted
        self.messages: tuple[ChatMessage, ...] = ()  # the conversation incl. the new input
        self._put = put
        self._on_finish = on_finish

    def emit(self, event: Struct) -> None:
        event.sequence_number = self.seq  # type: ignore[attr-defined]
        event.stream_id = self.request.stream_id  # type: ignore[attr-defined]
        if self._put(event):
            self.seq += 1

    def response(self, status: str, *, output: list[OutputMessage] | None = None,
                 usage: ResponseUsage | None = None, **extra) -> Response:
        req = self.request
        done = status not in ("in_progress", "queued")
        return Response(
            id=self.id, created_at=self.created_at, status=status, model=self.model,  # type: ignore[arg-type]
            output=output or [], usage=usage, instructions=req.instructions,
            metadata=req.metadata, temperature=self.temperature, top_p=self.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, tools=[],
            text=TextConfig(format=TextFormat()), store=req.store,
            completed_at=time.time() if done else None, **extra)

    def _message(self, status: str, text: str | None) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text, annotations=[], logprobs=[])]
        return OutputMessage(id=self.item_id, status=status, content=content)  # type: ignore[arg-type]

    def start(self) -> None:
        """The opening events (the engine has queued the request)."""
        self.emit(ResponseCreated(sequence_number=0, response=self.response("in_progress")))
        self.emit(ResponseInProgress(sequence_number=0, response=self.response("in_progress")))
        if self.request.generate:
            self.emit(OutputItemAdded(sequence_number=0, output_index=0,
                                      item=self._message("in_progress", None)))
            self.emit(ContentPartAdded(sequence_number=0, item_id=self.item_id, output_index=0,
                                       content_index=0,
                                       part=OutputText(text="", annotations=[], logprobs=[])))

    def on_event(self, event: Delta | Error | Done) -> None:
        """The engine's sink for this request."""
        if isinstance(event, Delta):
            if not self.request.generate:
                return  # a warm-up's one sampled token is dropped
            self.output_ids.extend(event.token_ids)
            if event.text:
                self.text.append(event.text)
                self.emit(OutputTextDelta(sequence_number=0, item_id=self.item_id,
                                          output_index=0, content_index=0, delta=event.text,
                                          logprobs=[]))
        elif isinstance(event, Error):
            self.error = event
        elif isinstance(event, Done):
            self._finish(event)

    def _finish(self, done: Done) -> None:
        self.finished = True
        reason = done.finish_reason
        generate = self.request.generate
        output_tokens = done.usage.completion_tokens if generate else 0
        usage = _usage(done.usage, output_tokens)
        if reason in ("stop", "length") and not generate:
            self.emit(ResponseCompleted(sequence_number=0,
                                        response=self.response("completed", usage=usage)))
        elif reason in ("stop", "length"):
            status = "completed" if reason == "stop" else "incomplete"
            text = "".join(self.text)
            part = OutputText(text=text, annotations=[], logprobs=[])
            ids = dict(item_id=self.item_id, output_index=0, content_index=0)
            self.emit(OutputTextDone(sequence_number=0, text=text, logprobs=[], **ids))
            self.emit(ContentPartDone(sequence_number=0, part=part, **ids))
            item = self._message(status, text)
            self.emit(OutputItemDone(sequence_number=0, output_index=0, item=item))
            if reason == "stop":
                self.emit(ResponseCompleted(sequence_number=0, response=self.response(
                    "completed", output=[item], usage=usage)))
            else:
                self.emit(ResponseIncomplete(sequence_number=0, response=self.response(
                    "incomplete", output=[item], usage=usage,
                    incomplete_details=IncompleteDetails(reason="max_output_tokens"))))
        else:
            if reason == "error":
                message = self.error.message if self.error is not None else "the engine failed"
                self.emit(ErrorEvent(sequence_number=0, status=500, error=ErrorDetail(
                    type="server_error", code="server_error", message=message, param=None)))
            else:
                message = "the response was cancelled (the server is shutting down or the " \
                          "connection closed)"
            self.emit(ResponseFailed(sequence_number=0, response=self.response(
                "failed", usage=usage,
                error=ResponseFailure(code="server_error", message=message))))
        self._on_finish(self, done)
