"""The OpenAI body's structured-output and tool fields -> engine request fields (pure).

Structured output, one source per request:
    response_format            OpenAI's {"type": "text" | "json_object" | "json_schema"}
    structured_outputs         vLLM's {"json": schema, "json_object": true, "regex": ...,
                               "choice": [...], "grammar": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names for them
They become the engine's `response_format` / `structured` params, checked there (a bad
schema or regex is a 400 naming the field the client sent).

Tools (chat only): `tools`, `tool_choice` ("none", "auto", "required", {"type": "function",
"function": {"name"}}) and `parallel_tool_calls` (true: several calls may follow each
other; absent or false: one call, llama.cpp's default), handed to the
engine (`service.engine.constraints.tools`).
"""

from __future__ import annotations

import json
from typing import Any

from service.front.openai.errors import bad

__all__ = ["STRUCTURED_FIELDS", "TOOL_FIELDS", "structured_fields", "tool_fields"]

_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *_ALIASES,
                     "guided_decoding_backend"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
_SO_KEYS = {"json", "json_object", "regex", "choice", "grammar"}


def _response_format(fmt: dict) -> dict:
    """OpenAI's response_format, with llama.cpp's `{"type": "json_object", "schema": S}`
    served as `json_schema` S (its server's extension; ignoring the schema would hand its
    users output that does not validate). Raises OpenAIError 400 naming a key that is none
    of `type`, `json_schema` (and `schema` with json_object), rather than ignoring it."""
    allowed = {"type", "json_schema"} | ({"schema"} if fmt["type"] == "json_object" else set())
    unknown = sorted(k for k in fmt if k not in allowed)
    if unknown:
        raise bad(f"response_format.{unknown[0]}",
                  f"response_format.{unknown[0]} is not supported", "unsupported_parameter")
    if fmt["type"] == "json_object" and "schema" in fmt:
        schema = fmt["schema"]
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.schema", "response_format.schema must be a JSON Schema "
                      "(an object or a boolean)", "invalid_type")
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    return fmt


def structured_fields(body: dict, params: dict[str, Any], renames: dict[str, str]) -> None:
    """Put the body's constraint into `params` (and where its errors point into
    `renames`). Raises OpenAIError 400 for a malformed or doubled constraint."""
    given: dict[str, tuple[str, Any]] = {}  # our key -> (the client's field, value)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad("response_format", "response_format must be an object with a `type`",
                      "invalid_type")
        fmt = _response_format(fmt)
        if fmt["type"] != "text":
            given["response_format"] = ("response_format", fmt)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "structured_outputs must be an object",
                      "invalid_type")
        unknown = sorted(k for k, v in so.items() if k not in _SO_KEYS and v is not None
                         and k not in ("disable_any_whitespace", "disable_additional_properties",
                                       "whitespace_pattern", "backend"))
        if unknown:
            raise bad(f"structured_outputs.{unknown[0]}",
                      f"structured_outputs.{unknown[0]} is not supported", "unsupported_parameter")
        for k in _SO_KEYS:
            if so.get(k) is not None and so.get(k) is not False:
                given[k] = (f"structured_outputs.{k}", so[k])
    for old, k in _ALIASES.items():
        if body.get(old) is not None:
            given[k if k not in given else old] = (old, body[old])
    if len(given) > 1:
        names = [field for field, _ in given.values()]
        raise bad(names[1], f"only one output constraint per request: {', '.join(names)}")
    if not given:
        return
    (key, (field, value)), = given.items()
    if key == "response_format":
        params["response_format"] = value
        renames["response_format"] = "response_format"
    elif key == "json_object":
        params["response_format"] = {"type": "json_object"}
        renames["response_format"] = field
    elif key in ("json", "guided_json"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(field, f"{field} is not valid JSON: {e}") from None
        params["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "structured_outputs", "schema": value}}
        renames["response_format"] = field
    else:
        base = key if key in ("regex", "choice", "grammar") else _ALIASES[key]
        params["structured"] = {base: value}
        renames["structured"] = field.removesuffix(f".{base}") if "." in field else field


def tool_fields(body: dict) -> dict[str, Any]:
    """EngineRequest's `tools` / `tool_choice` / parallel calls from a chat body ({} when
    there are none). Raises OpenAIError 400 for a malformed field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean", "invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "tools must be a list", "invalid_type")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad("tool_choice", f"tool_choice must be none, auto, required or "
                      f"{{\"type\": \"function\", ...}}, got {choice!r}")
    elif choice is not None and not isinstance(choice, dict):
        raise bad("tool_choice", "tool_choice must be a string or an object", "invalid_type")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool_choice needs `tools`")
        return {}
    out: dict[str, Any] = {"tools": tools, "tool_choice": choice}
    if parallel is True:  # else one call (see EngineRequest.parallel_tool_calls)
        out["parallel_tool_calls"] = True
    return out
