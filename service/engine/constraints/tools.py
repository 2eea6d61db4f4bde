"""ToolPlan: how a request's tools reach the prompt, and what its output may be.

Three styles, chosen per model from its chat template (`template_tool_style`, once):

    hermes   the template renders `tools` and its model answers with
             `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5,
             Hermes 2/3): tools and past calls go to the template as it expects them.
    llama    the template renders `tools` and its model answers with one bare JSON object
             `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    generic  the template ignores tools (SmolLM2's): the tool list goes into the system
             prompt with the hermes call form spelled out (`GENERIC_PROMPT`), as llama.cpp's
             server does for such templates, and past calls are written into the
             assistant turns in that form.

The output is constrained by a grammar (llguidance's Lark) built from the tools' JSON
Schemas, so a call always parses and its arguments validate:

    tool_choice "auto" (the default)   a plain answer that does not start like a call, or a call
    tool_choice "required"             a call
    tool_choice {"function": {name}}   exactly one call of that function
    tool_choice "none"                 tools not shown, output not constrained

"A call" is exactly one call, unless the client asked for parallel calls
(`parallel_tool_calls: true`; not the llama style, not a named function): then one or more,
separated by a newline. The call's JSON has no free whitespace (one way to write it), and
after its closing text the grammar is complete, so the only token it allows is EOS: a
model cannot drift into a second call or trailing text and spend max_tokens there (as
llama.cpp's server and vLLM constrain a `required` call; llama.cpp also defaults
`parallel_tool_calls` to false).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from protocol import ChatMessage, InvalidRequest
from protocol.structured import Tool, ToolChoiceFunction
from service.engine.constraints.grammar import (GrammarSource, close_objects, lark_grammar,
                                                lark_string)

__all__ = ["GENERIC_PROMPT", "STYLES", "ToolFormat", "ToolPlan", "template_tool_style"]

STYLES = ("hermes", "llama", "generic")


class ToolFormat(NamedTuple):
    """How one call is written: `open` + {"name": ..., args_key: {...}} + `close`;
    `many`: several calls may follow each other (separated by a newline)."""

    open: str
    close: str
    args_key: str
    many: bool


FORMATS = {"hermes": ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments", True),
           "generic": ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments", True),
           "llama": ToolFormat("", "", "parameters", False)}

GENERIC_PROMPT = """You can call functions. Their JSON Schemas, one a line:
<tools>
{tools}
</tools>
{rule} To call {what}, answer with nothing but {how}, written as:
<tool_call>
{{"name": "<function name>", "arguments": <its arguments as a JSON object>}}
</tool_call>"""
_RULES = {"auto": "Call a function when one helps; otherwise answer in plain text.",
          "required": "You must call a function."}

_PROBE = "conveyor_probe_function_7c1e"


def template_tool_style(tokenizer: Any) -> str:
    """"hermes", "llama" or "generic" for this tokenizer's chat template: generic unless
    the template renders a probe tool's name and its call form is one we know."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or not template:
        return "generic"
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                               "parameters": {"type": "object",
                                                              "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that fails with tools cannot take them
        return "generic"
    if _PROBE not in text:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "python_tag" in template or "ipython" in template:
        return "llama"
    return "generic"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools as the prompt and the output grammar see them.

    tools: the request's tools (1 to MAX_TOOLS); choice: "auto", "required" or a function
    name (`named`); style: one of STYLES; parallel: several calls may follow each other
    (where the style allows it; the client's `parallel_tool_calls: true`), else exactly
    one call, after which only EOS may come.
    """

    tools: tuple[Tool, ...]
    choice: str
    named: bool
    style: str
    parallel: bool = False

    @staticmethod
    def make(tools: Sequence[Tool] | None, tool_choice: str | ToolChoiceFunction | None,
             style: str, request_id: str | None = None, *,
             parallel: bool = False) -> ToolPlan | None:
        """The plan, or None when no tool may be called (no tools, or tool_choice "none").

        Raises InvalidRequest: tool_choice "required" or a function without tools, a
        function that is not among the tools, two tools of one name.
        """
        if tool_choice == "none":
            return None
        if not tools:
            if tool_choice is not None and tool_choice != "auto":
                raise InvalidRequest("tool_choice needs `tools`", param="$.tool_choice",
                                     request_id=request_id)
            return None
        names = [t.function.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidRequest(f"two tools are named {dup!r}", param="$.tools",
                                 request_id=request_id)
        if isinstance(tool_choice, ToolChoiceFunction):
            name = tool_choice.function.name
            if name not in names:
                raise InvalidRequest(f"tool_choice names {name!r}, which is not among the "
                                     f"tools ({', '.join(names)[:300]})",
                                     param="$.tool_choice.function.name", request_id=request_id)
            return ToolPlan(tuple(tools), name, True, style, parallel)
        return ToolPlan(tuple(tools), tool_choice or "auto", False, style, parallel)

    @property
    def format(self) -> ToolFormat:
        return FORMATS[self.style]

    @property
    def native(self) -> bool:
        return self.style != "generic"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` argument of the chat template (native styles), else None."""
        if not self.native:
            return None
        return [{"type": "function", "function": _function_dict(t)} for t in self.tools]

    def system_prompt(self) -> str | None:
        """The generic style's tool prompt (merged into the system turn), else None."""
        if self.native:
            return None
        lines = "\n".join(json.dumps(_function_dict(t), separators=(",", ":"),
                                     ensure_ascii=False) for t in self.tools)
        rule = f"You must call the function {self.choice}." if self.named \
            else _RULES[self.choice]
        many = self.parallel and not self.named
        return GENERIC_PROMPT.format(
            tools=lines, rule=rule, what="functions" if many else "a function",
            how="one or more calls, each one" if many else "the call")

    def grammar(self, request_id: str | None = None) -> GrammarSource:
        """The output grammar (see the module docstring)."""
        fmt = self.format
        tools = [t for t in self.tools if not self.named or t.function.name == self.choice]
        bodies = " | ".join(f"%json{json.dumps(_call_schema(t, fmt.args_key))}" for t in tools)
        call = " ".join(x for x in (lark_string(fmt.open) if fmt.open else "", "call_body",
                                    lark_string(fmt.close) if fmt.close else "") if x)
        calls = 'call ("\\n" call)*' if fmt.many and self.parallel and not self.named \
            else "call"
        if self.choice == "auto":
            start = "start: ANSWER | calls"
            # an answer that does not start like a call (after blanks)
            head = fmt.open.strip() or "{"
            answer = f"ANSWER: /(?s:.+)/ & ~/(?s:[ \\t\\n]*{_regex_escape(head)}.*)/"
        else:
            start, answer = "start: calls", ""
        lark = "\n".join(x for x in (start, f"calls: {calls}", f"call: {call}",
                                     f"call_body: {bodies}", answer) if x)
        return lark_grammar(lark, "$.tools", request_id)


def _function_dict(t: Tool) -> dict[str, Any]:
    f = t.function
    out: dict[str, Any] = {"name": f.name}
    if f.description:
        out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else {"type": "object",
                                                                        "properties": {}}
    return out


def _call_schema(t: Tool, args_key: str) -> dict[str, Any]:
    """JSON Schema of one call's object: the name (constant) first, then the arguments.
    Lenient: keywords llguidance does not enforce (e.g. an unknown `format`) are ignored
    rather than refusing the tool list (a chat front end sends its tools with every
    message; refusing them would refuse every message). Objects closed (`close_objects`),
    and no free whitespace: one way to write a call (a small model given room for blanks
    may spend its tokens on them)."""
    params = t.function.parameters if t.function.parameters is not None else {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": t.function.name}, args_key: close_objects(params)},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": {"lenient": True, "whitespace_flexible": False}}


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust's regex syntax: only its
    metacharacters are escaped; `\\<` would be a word boundary there)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def history_turns(messages: Sequence[ChatMessage], style: str,
                  system_prompt: str | None) -> list[dict[str, Any]]:
    """Chat turns as dicts for the template: past tool calls and results in the style's
    form (native: `tool_calls` with arguments as objects, `tool_call_id`; generic: the
    calls written into the assistant's content), and the generic tool prompt merged into
    the first system turn (or a new one)."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            if style == "generic":
                fmt = FORMATS["generic"]
                calls = "\n".join(
                    fmt.open + json.dumps({"name": c.function.name, fmt.args_key:
                                           _arguments(c.function.arguments)},
                                          ensure_ascii=False) + fmt.close
                    for c in m.tool_calls)
                turn["content"] = (turn["content"] + "\n" if turn["content"] else "") + calls
            else:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.function.name,
                                                    "arguments": _arguments(c.function.arguments)}}
                                      for c in m.tool_calls]
        if m.role == "tool" and style != "generic":
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                turn["name"] = m.name
        turns.append(turn)
    if system_prompt:
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = system_prompt + "\n\n" + turns[0]["content"]
        else:
            turns.insert(0, {"role": "system", "content": system_prompt})
    return turns
