"""The OpenAI Responses API's WebSocket mode (`/v1/responses`): our side of its frames.

Pure msgspec Structs, like protocol/messages.py, for the text subset Conveyor serves.
The reference is the official `openai` SDK's generated types
(`openai/types/responses/responses_client_event.py`, `responses_server_event.py` and
the event classes they import); tests check that every event here validates as them.

One text response streams, in this order (`sequence_number` counts from 0 per response):

    response.created            Response(status="in_progress")
    response.in_progress
    response.output_item.added  message item (status "in_progress", no content)
    response.content_part.added output_text part (text "")
    response.output_text.delta  one per streamed delta (a slow reader's merge)
    response.output_text.done   the whole text
    response.content_part.done
    response.output_item.done   message item (status "completed" or "incomplete")
    response.completed | response.incomplete (incomplete_details.reason
                                "max_output_tokens") | response.failed

With tools, the message item opens with the first text, and each function call is an
item of its own, in the order the model wrote them (`output_index` 0, 1, ...):

    response.output_item.added              function_call item (arguments "", in_progress)
    response.function_call_arguments.delta  arguments text, piece by piece
    response.function_call_arguments.done   the whole arguments
    response.output_item.done               function_call item (completed | incomplete)

A warm-up (`generate: false`) is created, in_progress, completed with no output.
Errors are `error` events shaped as the SDK's `ResponseWsError`: {"type": "error",
"status": 400, "error": {"type", "code", "message", "param"}, "sequence_number"}.
Fields are omitted only where the SDK marks them optional and absent (`stream_id`).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from msgspec import Struct

__all__ = [
    "ContentPartAdded", "ContentPartDone", "ErrorDetail", "ErrorEvent", "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone", "FunctionCallItem", "IncompleteDetails", "OutputItem",
    "InputTokensDetails", "OutputItemAdded", "OutputItemDone", "OutputMessage", "OutputText",
    "OutputTextDelta", "OutputTextDone", "OutputTokensDetails", "Response", "ResponseCompleted",
    "ResponseCreated", "ResponseFailed", "ResponseFailure", "ResponseInProgress",
    "ResponseIncomplete", "ResponseUsage", "ServerEvent", "TextConfig", "TextFormat",
]

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


# --- the Response object -------------------------------------------------------------------

class OutputText(Struct, tag="output_text", tag_field="type", kw_only=True):
    """An `output_text` content part: the assistant's text (no annotations, no logprobs)."""

    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(Struct, tag="message", tag_field="type", kw_only=True):
    """The one output item of a text response: an assistant message."""

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Struct, tag="function_call", tag_field="type", kw_only=True):
    """A function call the model made: `call_id` ("call_..."; a `function_call_output`
    input item answers it), the function's `name` and its `arguments` (a JSON text;
    those of a call cut by max_output_tokens do not parse: status "incomplete")."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[OutputMessage, FunctionCallItem]


class InputTokensDetails(Struct, kw_only=True):
    """`cached_tokens`: prompt tokens served from the prefix cache; `cache_write_tokens`:
    prompt tokens computed (and so written to the KV cache) by this response."""

    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    """Token counts; `total_tokens` = input + output."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseFailure(Struct, kw_only=True):
    """`Response.error` of a failed response (`code` from the SDK's ResponseError list)."""

    code: Literal["server_error", "rate_limit_exceeded"]
    message: str


class TextFormat(Struct, kw_only=True):
    type: Literal["text"] = "text"


class TextConfig(Struct, kw_only=True):
    """`text` of the Response: its `format`, a TextFormat or the request's own
    json_object / json_schema format (a dict, echoed)."""

    format: Any


class Response(Struct, kw_only=True):
    """The Response object as the events carry it (`object` is always "response").

    created_at / completed_at: Unix time, seconds. temperature, top_p: what sampled it
    (the request's, else the model's defaults). previous_response_id, instructions,
    metadata, max_output_tokens, store, tools (flat function tools), tool_choice ("none",
    "auto", "required" or {"type": "function", "name"}), parallel_tool_calls: as the
    request gave them.
    """

    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseFailure | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str]
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool = False
    tool_choice: Any = "none"
    tools: list[Any]
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    completed_at: float | None = None


# --- server events -----------------------------------------------------------------------

class _Event(Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every server event: `sequence_number` orders one response's events;
    `stream_id` echoes the create's lane and is omitted when it had none."""

    sequence_number: int
    stream_id: str | None = None


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: Response


class ResponseFailed(_Event, tag="response.failed"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    """New arguments text of the function call item `item_id`."""

    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    """The call's whole arguments text (sent before its output_item.done)."""

    item_id: str
    output_index: int
    arguments: str


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


DELTA_OVERHEAD_BYTES = 160
"""Estimated JSON bytes of an output_text.delta event besides its text."""


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    """New text of one content part. While it waits in a slow reader's outbox, a later
    delta of the same part merges into it (`absorb`, service/front/ws/outbox.py's Appendable)."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]

    def absorb(self, later: Any) -> bool:
        if not (isinstance(later, OutputTextDelta) and later.item_id == self.item_id
                and later.content_index == self.content_index
                and later.stream_id == self.stream_id):
            return False
        self.delta += later.delta
        return True

    def pending_bytes(self) -> int:
        return len(self.delta.encode("utf-8", "surrogatepass")) + DELTA_OVERHEAD_BYTES


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ErrorDetail(Struct, kw_only=True):
    """`type`: "invalid_request_error", "server_error", ...; `code`: e.g.
    "previous_response_not_found"; `param`: the offending field (e.g. "input[0].role")."""

    type: str
    code: str | None
    message: str
    param: str | None


class ErrorEvent(_Event, tag="error"):
    """A request-scoped error; `status` is the HTTP status the same error would have had."""

    status: int
    error: ErrorDetail


ServerEvent = Union[ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete,
                    ResponseFailed, OutputItemAdded, OutputItemDone, ContentPartAdded,
                    ContentPartDone, OutputTextDelta, OutputTextDone, FunctionCallArgumentsDelta,
                    FunctionCallArgumentsDone, ErrorEvent]
