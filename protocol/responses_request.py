"""`response.create` frames of the Responses WebSocket mode: decoded, checked, normalized.

`parse_client_frame(data)` turns one client frame of the WebSocket mode into a
`CreateRequest`, `parse_create_body(body)` the body of `POST /v1/responses`; both raise
`ResponsesError`, whose `event()` is the `error` event to send (the socket stays open) and
whose `status` / `code` / `param` the HTTP route answers with. What Conveyor serves is
the text and function-tool subset of the Responses create body:

- used: `model`, `input` (a string, or items: messages with role user / system /
  developer / assistant and `content` as a string or `input_text` / `output_text`
  parts, `developer` becoming a `system` turn; `function_call` and
  `function_call_output` items, protocol/responses_tools.py), `instructions`,
  `max_output_tokens`, `temperature`, `top_p`, `previous_response_id`, `store`,
  `metadata`, `generate`, `stream_id` (the WebSocket lane, echoed on the response's
  events; not over HTTP), `stream` (HTTP: SSE or one JSON body; the WebSocket mode always
  streams), `text.format` (`text`, `json_object`, or `json_schema` with `name` / `schema`
  / `strict`: structured output, sampling constrained so the text parses and validates),
  `tools` (function tools, flat), `tool_choice` (none / auto / required / a function),
  `parallel_tool_calls` (true: one or more calls; absent or false: one call, as on the
  chat route);
- accepted without effect: `max_tool_calls`, and hints with no meaning here (`user`,
  `safety_identifier`, `service_tier`, `prompt_cache_key`, `prompt_cache_retention`,
  `prompt_cache_options`, `stream_options`, `access_programs`, `image`), and empty or
  default values of the unsupported ones (`include: []`, `text: {"format": {"type":
  "text"}}`, `truncation: "disabled"`, ...);
- refused with `unsupported_parameter` / `unsupported_value` naming the param: built-in
  tools, include, reasoning, conversation, prompt, background, top_logprobs,
  context_management, moderation, truncation "auto", input items other than messages
  and function calls (reasoning, item references), and content parts other than text
  (images, files, audio);
- unknown fields get `unknown_parameter`, as OpenAI's API answers them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from protocol.messages import INT32_MAX, ChatMessage
from protocol.responses_error import ResponsesError
from protocol.responses_tools import call_turns, chat_tool_choice, chat_tools
from protocol.structured import Tool, ToolChoiceFunction

__all__ = ["CreateRequest", "ResponsesError", "parse_client_frame", "parse_create_body"]

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
IGNORED = frozenset({
    "type", "max_tool_calls", "user", "safety_identifier",
    "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "stream_options", "access_programs", "image", "text",
})
UNSUPPORTED = frozenset({
    "include", "reasoning", "conversation", "prompt", "background",
    "background_options", "top_logprobs", "context_management", "moderation", "truncation",
})


class _Fields(Struct, kw_only=True):
    """The create body's fields Conveyor reads, with their ranges."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Meta(max_length=64)],
                             Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None
    generate: bool | None = None
    stream_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    stream: bool | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = None  # checked by protocol/responses_tools.py
    tool_choice: Any = None


KNOWN = frozenset(_Fields.__struct_fields__) | IGNORED | UNSUPPORTED


class CreateRequest(Struct, kw_only=True):
    """A checked `response.create`: `messages` are its new input items as chat turns.

    tools: the function tools (None: none); tool_choice: None (unset), "none", "auto",
    "required" or a ToolChoiceFunction; parallel_tool_calls: several calls may follow each
    other. stream: HTTP only (the WebSocket mode always streams).
    """

    model: str | None
    messages: list[ChatMessage]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    generate: bool
    stream_id: str | None
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = False
    stream: bool = True


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """text.format as the engine's `response_format` (None for text): the Responses API
    puts name / schema / strict beside `type`, chat completions under `json_schema`."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


_decoder = msgspec.json.Decoder(dict[str, Any])


def _unsupported(param: str, what: str, *, value: bool = False) -> ResponsesError:
    return ResponsesError(f"{what} is not supported by this server (Conveyor serves text "
                          f"generation only)", param=param,
                          code="unsupported_value" if value else "unsupported_parameter")


def _check_unsupported(body: dict[str, Any]) -> None:
    """Raise for the first field that asks for something this server cannot do."""
    for key in sorted(set(body) - KNOWN):
        raise ResponsesError(f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    get = body.get
    if get("include"):
        raise _unsupported("include", "include")
    reasoning = get("reasoning")
    if reasoning and (not isinstance(reasoning, dict) or any(v is not None
                                                             for v in reasoning.values())):
        raise _unsupported("reasoning", "reasoning")
    text = get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise ResponsesError("text must be an object", param="text", code="invalid_type")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in
                            ("text", "json_object", "json_schema")):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise _unsupported("text.format", f"text.format {kind!r}", value=True)
    for key in ("conversation", "prompt", "background_options", "moderation"):
        if get(key) is not None:
            raise _unsupported(key, key)
    if get("background"):
        raise _unsupported("background", "background (not available over WebSocket)")
    if get("top_logprobs"):
        raise _unsupported("top_logprobs", "top_logprobs")
    if get("context_management"):
        raise _unsupported("context_management", "context_management (compaction)")
    if get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "truncation 'auto'", value=True)


def _messages(raw: str | list[dict[str, Any]] | None) -> list[ChatMessage]:
    """The input as chat turns; raises ResponsesError naming the bad item or part."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [ChatMessage("user", raw)]
    turns: list[ChatMessage] = []
    names: dict[str, str] = {}  # call_id -> function name
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            call_turns(turns, item, i, names)
            continue
        if kind != "message":
            raise _unsupported(f"input[{i}].type", f"input items of type {kind!r}", value=True)
        role = item.get("role")
        if role not in ROLES:
            raise ResponsesError(f"Invalid value: {role!r}. Supported values are: 'user', "
                                 f"'system', 'developer' and 'assistant'.",
                                 param=f"input[{i}].role", code="invalid_value")
        content = item.get("content")
        if isinstance(content, str):
            turns.append(ChatMessage(ROLES[role], content))
            continue
        if not isinstance(content, list):
            raise ResponsesError("content must be a string or a list of content parts",
                                 param=f"input[{i}].content", code="invalid_type")
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ResponsesError(f"each content part must be an object with a type, got "
                                     f"{type(part).__name__}", param=f"input[{i}].content[{j}]",
                                     code="invalid_type")
            ptype = part.get("type")
            if ptype not in TEXT_PARTS:
                raise _unsupported(f"input[{i}].content[{j}].type",
                                   f"content parts of type {ptype!r} (images, files, audio)",
                                   value=True)
            if not isinstance(part.get("text"), str):
                raise ResponsesError("text must be a string", code="invalid_type",
                                     param=f"input[{i}].content[{j}].text")
            texts.append(part["text"])
        turns.append(ChatMessage(ROLES[role], "".join(texts)))
    return turns


def _param(e: msgspec.ValidationError) -> str | None:
    """msgspec's "... - at `$.metadata`" -> "metadata"; "$.input[0]" -> "input[0]"."""
    _, sep, where = str(e).rpartition(" - at `$")
    if not sep:
        return None
    return where.rstrip("`").lstrip(".") or None


def parse_client_frame(data: str | bytes) -> CreateRequest:
    """Decode one client frame of the Responses WebSocket mode.

    Raises ResponsesError: invalid JSON (`invalid_json`), a `type` other than
    "response.create" (`unsupported_value` for "response.steer", `invalid_value`
    otherwise), an unknown field (`unknown_parameter`), an unsupported feature
    (`unsupported_parameter` / `unsupported_value`), a wrong type or a value out of
    range (`invalid_value`, `param` naming the field).
    """
    try:
        body = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeError, RecursionError) as e:
        raise ResponsesError(f"We could not parse the JSON body of your request: {e}",
                             code="invalid_json") from None
    try:
        kind = body.get("type")
        if kind != "response.create":
            if kind == "response.steer":
                raise _unsupported("type", "response.steer", value=True)
            raise ResponsesError(f"Invalid value: {kind!r}. Supported values are: "
                                 f"'response.create'.", param="type", code="invalid_value")
        return _parse_create(body)
    except ResponsesError as e:  # the error answers on the frame's lane
        sid = body.get("stream_id")
        if isinstance(sid, str) and 0 < len(sid) <= 128:
            e.stream_id = sid
        raise


def parse_create_body(body: Any) -> CreateRequest:
    """The decoded JSON body of `POST /v1/responses` (no `type`; `stream` false unless
    given; no `stream_id`, a WebSocket lane). Raises ResponsesError as
    `parse_client_frame` does (`invalid_type` for a body that is not an object)."""
    if not isinstance(body, dict):
        raise ResponsesError("the body must be a JSON object", code="invalid_type")
    if body.get("stream_id") is not None:
        raise ResponsesError("stream_id is a lane of the WebSocket mode; over HTTP each "
                             "request is its own response", param="stream_id",
                             code="unsupported_parameter")
    req = _parse_create(body)
    return msgspec.structs.replace(req, stream=body.get("stream") is True)


def _parse_create(body: dict[str, Any]) -> CreateRequest:
    _check_unsupported(body)
    try:
        f = msgspec.convert({k: v for k, v in body.items()
                             if k in _Fields.__struct_fields__}, _Fields)
    except msgspec.ValidationError as e:
        raise ResponsesError(f"Invalid value: {e}", param=_param(e),
                             code="invalid_value") from None
    messages = _messages(f.input)
    if not messages and f.previous_response_id is None:
        raise ResponsesError("input must hold at least one message (or continue a response "
                             "with previous_response_id)", param="input",
                             code="missing_required_parameter")
    tools = chat_tools(f.tools)
    choice = chat_tool_choice(f.tool_choice, tools)
    return CreateRequest(model=f.model, messages=messages, instructions=f.instructions,
                         max_output_tokens=f.max_output_tokens, temperature=f.temperature,
                         top_p=f.top_p, previous_response_id=f.previous_response_id,
                         store=True if f.store is None else f.store,
                         metadata=dict(f.metadata or {}),
                         generate=True if f.generate is None else f.generate,
                         stream_id=f.stream_id, response_format=_response_format(body),
                         tools=tools or None, tool_choice=choice,
                         parallel_tool_calls=f.parallel_tool_calls is True)
