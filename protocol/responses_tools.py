"""The Responses API's function tools and call items, in the shapes chat completions uses.

The Responses API writes a function tool flat, chat completions (and the engine,
`protocol.structured.Tool`) nest it under `function`:

    {"type": "function", "name", "description", "parameters", "strict"}
        -> {"type": "function", "function": {"name", "description", "parameters", "strict"}}
    tool_choice {"type": "function", "name": "f"}
        -> {"type": "function", "function": {"name": "f"}}

and past calls and their results are input items, which become chat turns:

    {"type": "function_call", "call_id", "name", "arguments"}
        -> a `tool_calls` entry of an assistant turn (calls that follow each other, and an
           assistant message right before them, share one turn, as a chat answer with
           text and parallel calls does)
    {"type": "function_call_output", "call_id", "output"}
        -> a `tool` turn with `tool_call_id` (and the function's `name` when its call is
           among the items)

Only function tools are served: built-in tools (web_search, file_search, mcp, ...) and
tool_choice forms other than none / auto / required / a function are refused with
`unsupported_value` naming the field. Pure (msgspec), like the rest of protocol/.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import ChatMessage
from protocol.responses_error import ResponsesError
from protocol.structured import (MAX_TOOLS, FunctionCall, FunctionName, Tool, ToolCall,
                                 ToolChoiceFunction)

__all__ = ["call_turns", "chat_tool_choice", "chat_tools", "flat_tool", "flat_tool_choice"]

TEXT_PARTS = ("input_text", "output_text")


def _unsupported(param: str, what: str) -> ResponsesError:
    return ResponsesError(f"{what} is not supported by this server (Conveyor serves "
                          f"function tools only)", param=param, code="unsupported_value")


def chat_tools(raw: Any) -> list[Tool]:
    """`tools` as the engine's Tools ([] for none). Raises ResponsesError naming the entry:
    not a list / not an object (`invalid_type`), a built-in tool (`unsupported_value`),
    more than MAX_TOOLS or a bad name or parameters (`invalid_value`)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ResponsesError("tools must be a list", param="tools", code="invalid_type")
    if len(raw) > MAX_TOOLS:
        raise ResponsesError(f"at most {MAX_TOOLS} tools, got {len(raw)}", param="tools",
                             code="invalid_value")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise ResponsesError("each tool must be an object", param=f"tools[{i}]",
                                 code="invalid_type")
        if t.get("type") != "function":
            raise _unsupported(f"tools[{i}].type", f"tools of type {t.get('type')!r}")
        function = {k: t[k] for k in ("name", "description", "parameters", "strict")
                    if t.get(k) is not None}
        try:
            tools.append(msgspec.convert({"type": "function", "function": function}, Tool))
        except msgspec.ValidationError as e:
            where = str(e).rpartition(" - at `$.function")[2].rstrip("`")
            raise ResponsesError(f"Invalid value: {e}", param=f"tools[{i}]{where}",
                                 code="invalid_value") from None
    return tools


def chat_tool_choice(raw: Any, tools: list[Tool]) -> str | ToolChoiceFunction | None:
    """`tool_choice` as the engine takes it (None: unset, "auto" with tools). Raises
    ResponsesError: another form (`unsupported_value`), "required" or a function without
    tools, or a function that is not among them (`invalid_value`)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ResponsesError(f"Invalid value: {raw!r}. Supported values are: 'none', "
                                 f"'auto' and 'required'.", param="tool_choice",
                                 code="invalid_value")
        if raw == "required" and not tools:
            raise ResponsesError("tool_choice 'required' needs tools", param="tool_choice",
                                 code="invalid_value")
        return raw
    if not isinstance(raw, dict):
        raise ResponsesError("tool_choice must be a string or an object", param="tool_choice",
                             code="invalid_type")
    if raw.get("type") != "function":
        raise _unsupported("tool_choice.type", f"tool_choice of type {raw.get('type')!r}")
    name = raw.get("name")
    if not isinstance(name, str):
        raise ResponsesError("tool_choice of type 'function' needs the function's `name`",
                             param="tool_choice.name", code="missing_required_parameter")
    names = [t.function.name for t in tools]
    if name not in names:
        shown = ", ".join(names)[:300] or "none"
        raise ResponsesError(f"tool_choice names the function {name[:64]!r}, which is not "
                             f"among the tools ({shown})", param="tool_choice.name",
                             code="invalid_value")
    return ToolChoiceFunction(function=FunctionName(name))


def flat_tool(tool: Tool) -> dict[str, Any]:
    """A Tool in the Responses API's flat shape (the Response object echoes them)."""
    f = tool.function
    return {"type": "function", "name": f.name, "description": f.description,
            "parameters": f.parameters, "strict": f.strict}


def flat_tool_choice(choice: str | ToolChoiceFunction | None, has_tools: bool) -> Any:
    """tool_choice as the Response object shows it: the string, or {"type", "name"}."""
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "name": choice.function.name}
    return choice or ("auto" if has_tools else "none")


def _text(value: Any, param: str) -> str:
    """A call output: a string, or a list of input_text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS \
                    or not isinstance(part.get("text"), str):
                raise ResponsesError("a function call's output must be a string or a list of "
                                     "input_text parts (images and files are not served)",
                                     param=f"{param}[{j}]", code="invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise ResponsesError("output must be a string", param=param, code="invalid_type")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ResponsesError(f"{key} must be a non-empty string" if key != "arguments"
                             else "arguments must be a string (the call's JSON)",
                             param=f"input[{i}].{key}", code="invalid_value"
                             if value is None or isinstance(value, str) else "invalid_type")
    return value


def call_turns(turns: list[ChatMessage], item: dict[str, Any], i: int,
               names: dict[str, str]) -> None:
    """Append input item `i`, a function_call or a function_call_output, to `turns` (see
    the module docstring). `names`: call_id -> function name of the calls seen so far
    (updated). Raises ResponsesError naming the item's bad field."""
    kind = item.get("type")
    call_id = _string(item, "call_id", i)
    if kind == "function_call":
        name, arguments = _string(item, "name", i), _string(item, "arguments", i)
        names[call_id] = name
        call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant":
            turns[-1] = ChatMessage("assistant", last.content or None,
                                    tool_calls=[*(last.tool_calls or ()), call])
        else:
            turns.append(ChatMessage("assistant", None, tool_calls=[call]))
        return
    output = _text(item.get("output"), f"input[{i}].output")
    turns.append(ChatMessage("tool", output, tool_call_id=call_id, name=names.get(call_id)))
