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
from protocol.responses import (ErrorDetail, ErrorEvent, IncompleteDetails, InputTokensDetails,
                                OutputItem, OutputTokensDetails, Response, ResponseCompleted,
                                ResponseCreated, ResponseFailed, ResponseFailure,
                                ResponseIncomplete, ResponseInProgress, ResponseUsage,
                                TextConfig, TextFormat)
from protocol.responses_request import CreateRequest
from protocol.responses_tools import flat_tool, flat_tool_choice
from service.front.ws.responses.items import OutputItems

__all__ = ["ResponseRun", "new_response_id", "tools_active"]


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def tools_active(req: CreateRequest) -> bool:
    """The model may call a function: tools given and tool_choice not "none"."""
    return bool(req.tools) and req.tool_choice != "none"


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
        put: where events go (the connection's outbox `put`, or the HTTP route's queue;
            True when the event was queued on its own, False when it merged into a
            waiting one).
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
        self.created_at = time.time()
        self.seq = 0
        self.output = OutputItems(self.emit, "msg_" + uuid.uuid4().hex)
        self.output_ids: list[int] = []
        self.error: Error | None = None
        self.finished = False
        self.final: Response | None = None  # the Response of the terminal event
        self.prompt_ids: list[int] = []  # set when admitted
        self.messages: tuple[ChatMessage, ...] = ()  # the conversation incl. the new input
        self.tools_key: str | None = None  # how the prompt rendered the tools (context.py)
        self._put = put
        self._on_finish = on_finish

    @property
    def text(self) -> list[str]:
        """The message's text pieces so far."""
        return self.output.text

    @property
    def item_id(self) -> str:
        return self.output.message_id

    def emit(self, event: Struct) -> None:
        event.sequence_number = self.seq  # type: ignore[attr-defined]
        event.stream_id = self.request.stream_id  # type: ignore[attr-defined]
        if self._put(event):
            self.seq += 1

    def response(self, status: str, *, output: list[OutputItem] | None = None,
                 usage: ResponseUsage | None = None, **extra) -> Response:
        req = self.request
        done = status not in ("in_progress", "queued")
        tools = req.tools or []
        fmt = req.response_format
        text_format = TextFormat() if fmt is None else \
            {"type": "json_object"} if fmt["type"] == "json_object" else \
            {"type": "json_schema", **fmt["json_schema"]}
        return Response(
            id=self.id, created_at=self.created_at, status=status, model=self.model,  # type: ignore[arg-type]
            output=output or [], usage=usage, instructions=req.instructions,
            metadata=req.metadata, temperature=self.temperature, top_p=self.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            tools=[flat_tool(t) for t in tools],
            tool_choice=flat_tool_choice(req.tool_choice, bool(tools)),
            parallel_tool_calls=req.parallel_tool_calls,
            text=TextConfig(format=text_format), store=req.store,
            completed_at=time.time() if done else None, **extra)

    def start(self) -> None:
        """The opening events (the engine has queued the request). With tools the message
        item opens with the first text (the output may be calls only)."""
        self.emit(ResponseCreated(sequence_number=0, response=self.response("in_progress")))
        self.emit(ResponseInProgress(sequence_number=0, response=self.response("in_progress")))
        if self.request.generate and not tools_active(self.request):
            self.output.open_message()

    def on_event(self, event: Delta | Error | Done) -> None:
        """The engine's sink for this request."""
        if isinstance(event, Delta):
            if not self.request.generate:
                return  # a warm-up's one sampled token is dropped
            self.output_ids.extend(event.token_ids)
            self.output.add_text(event.text)
            if event.tool_calls:
                self.output.add_call_pieces(event.tool_calls)
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
        if reason in ("stop", "length", "tool_calls") and not generate:
            self._end(ResponseCompleted, self.response("completed", usage=usage))
        elif reason in ("stop", "length", "tool_calls"):
            self.output.close_all(complete=reason != "length")
            items = list(self.output.items)
            if reason != "length":
                self._end(ResponseCompleted, self.response(
                    "completed", output=items, usage=usage))
            else:
                self._end(ResponseIncomplete, self.response(
                    "incomplete", output=items, usage=usage,
                    incomplete_details=IncompleteDetails(reason="max_output_tokens")))
        else:
            if reason == "error":
                message = self.error.message if self.error is not None else "the engine failed"
                self.emit(ErrorEvent(sequence_number=0, status=500, error=ErrorDetail(
                    type="server_error", code="server_error", message=message, param=None)))
            else:
                message = "the response was cancelled (the server is shutting down or the " \
                          "connection closed)"
            self._end(ResponseFailed, self.response(
                "failed", usage=usage,
                error=ResponseFailure(code="server_error", message=message)))
        self._on_finish(self, done)

    def _end(self, kind: type, response: Response) -> None:
        self.final = response
        self.emit(kind(sequence_number=0, response=response))
