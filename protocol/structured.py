"""Structured output and tool calling on the wire (PROTOCOL.md's `response_format`,
`structured`, `tools`, `tool_choice`, and the `tool_calls` of deltas and `done`).

msgspec Structs, decoded like every other field of a frame: a wrong type names its JSON
path (`$.params.response_format.type`). What a schema, a regex or a grammar *means* is
checked where it is compiled (`service.engine.constraints`), not here: a schema the
constraint library cannot serve, an invalid regex or a grammar that admits nothing is an
`invalid_request` naming the field, before the request is queued.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta, Struct

__all__ = [
    "MAX_CHOICES",
    "MAX_TOOLS",
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDefinition",
    "FunctionName",
    "JsonSchemaFormat",
    "ResponseFormat",
    "Structured",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolChoiceFunction",
]

MAX_CHOICES = 256
"""Most alternatives a `structured.choice` may list."""
MAX_TOOLS = 128
"""Most tools one request may carry (Open WebUI sends 36)."""

FunctionNameStr = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]
"""A function's name as OpenAI allows it: 1 to 64 of a-z, A-Z, 0-9, `_`, `.`, `:`, `-`."""


class JsonSchemaFormat(Struct, frozen=True, kw_only=True):
    """`response_format.json_schema`: OpenAI's {name, schema, strict, description}.

    schema: a JSON Schema (an object; `true` admits any JSON value). None: any JSON object.
    strict: accepted either way: the output always validates (sampling is constrained).
    """

    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, frozen=True, kw_only=True):
    """`{"type": "text"}` (no constraint), `{"type": "json_object"}` (one JSON object) or
    `{"type": "json_schema", "json_schema": {...}}` (valid against the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")


class Structured(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Other constraints than JSON, at most one of them.

    regex: the completion matches it whole (the constraint library's regex syntax: Rust's
        `regex` crate, no look-around or back-references).
    choice: the completion is exactly one of these strings (1 to MAX_CHOICES of them).
    grammar: a context-free grammar the completion belongs to: Lark syntax as llguidance
        reads it (`start: ...`), or llama.cpp's GBNF (`root ::= ...`), which is converted.
    """

    regex: Annotated[str, Meta(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        given = [f for f in ("regex", "choice", "grammar") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"structured must hold exactly one of regex, choice, grammar, "
                             f"got {', '.join(given) or 'none'}")


class FunctionDefinition(Struct, frozen=True, kw_only=True):
    """A tool's function: its name, what it does, and the JSON Schema of its arguments
    (None: an object of any properties)."""

    name: FunctionNameStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, frozen=True, kw_only=True):
    """One entry of `tools`: OpenAI's `{"type": "function", "function": {...}}`."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(Struct, frozen=True):
    name: FunctionNameStr


class ToolChoiceFunction(Struct, frozen=True, kw_only=True):
    """`tool_choice` naming one function: the completion is a call of it."""

    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Union[Literal["none", "auto", "required"], ToolChoiceFunction]


class FunctionCall(Struct, frozen=True):
    """A call's function: its name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(Struct, frozen=True, kw_only=True):
    """One complete tool call (an assistant message's `tool_calls`, a `done`'s)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionCallDelta(Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a tool call in a delta (OpenAI's chunk shape): `id`, `type` and the
    function's `name` in the first piece of each call, `arguments` text in every piece;
    `index` numbers the calls of one completion from 0."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: Literal["function"] | None = None
