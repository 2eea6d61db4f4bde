"""ToolPlan: how a request's tools reach the prompt, and what its output may be.

Three styles, chosen per model from its chat template (`template_tool_style`, once):

    hermes   the template renders `tools` and its model answers with
             `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5,
             Hermes 2/3): tools and past calls go to the template as it expects them.
    llama    the template renders `tools` and its model answers with one bare JSON object
             `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    generic  the template ignores tools (SmolLM2's): the tool list goes into the system
             prompt (`GENERIC_PROMPT`) and the whole completion is one JSON object, as
             llama.cpp's server's generic form: `{"response": "<the answer>"}`,
             `{"tool_call": {"name": ..., "arguments": {...}}}`, or with parallel calls
             `{"tool_calls": [{...}, ...]}` (the format's `envelope`; parsed by
             `envelope_parser.EnvelopeParser`). Past calls and their results are
             written as sentences (`history_turns`).

             Why an envelope and not a plain answer beside the call form: a small chat
             model given the choice between free text and `<tool_call>` answers in free
             text even when told to call (SmolLM2-135M with Open WebUI's 36 tools wrote
             Python that calls get_current_timestamp, 2026-12-06); made to choose between
             the keys "response" and "tool_call" after `{"`, it called the function
             when asked to and answered plain questions.

The output is constrained by a grammar (llguidance's Lark) built from the tools' JSON
Schemas, so a call always parses and its arguments validate:

    tool_choice "auto" (the default)   a plain answer that does not start like a call (generic:
                                       {"response": ...}), or a call
    tool_choice "required"             a call
    tool_choice {"function": {name}}   exactly one call of that function
    tool_choice "none"                 tools not shown, output not constrained

"A call" is exactly one call, unless the client asked for parallel calls
(`parallel_tool_calls: true`; not the llama style, not a named function): then one or more,
separated by a newline (generic: the `tool_calls` list). The call's JSON has no free
whitespace (one way to write it), and after its closing text the grammar is complete, so
the only token it allows is EOS: a model cannot drift into a second call or trailing text
and spend max_tokens there (as llama.cpp's server and vLLM constrain a `required` call;
llama.cpp also defaults `parallel_tool_calls` to false).
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

__all__ = ["ANSWER_OPEN", "GENERIC_PROMPT", "MANY_OPEN", "ONE_OPEN", "STYLES", "ToolFormat",
           "ToolPlan", "template_tool_style"]

STYLES = ("hermes", "llama", "generic")


class ToolFormat(NamedTuple):
    """How one call is written: `open` + {"name": ..., args_key: {...}} + `close`;
    `many`: several calls may follow each other (separated by a newline); `envelope`: the
    generic form instead, where the completion is one JSON object holding the answer or
    the calls (module docstring)."""

    open: str
    close: str
    args_key: str
    many: bool
    envelope: bool = False


FORMATS = {"hermes": ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments", True),
           "generic": ToolFormat("", "", "arguments", True, envelope=True),
           "llama": ToolFormat("", "", "parameters", False)}

GENERIC_PROMPT = """Functions you may call:
{tools}

{rule}"""
_CALL = '{{"name": "<function name>", "arguments": {{...}}}}'
_RULES = {
    "auto": 'Respond in JSON format, either with "response" (your reply to the user\'s '
            'request), written as {{"response": "<your reply>"}}, or with "tool_call" (a '
            'request to call a function), written as {{"tool_call": ' + _CALL + '}}.',
    "auto-many": 'Respond in JSON format, either with "response" (your reply to the user\'s '
                 'request), written as {{"response": "<your reply>"}}, or with "tool_calls" '
                 '(requests to call functions, one or more), written as {{"tool_calls": [' +
                 _CALL + ', ...]}}.',
    "required": 'You must call a function. Respond in JSON format with "tool_call", '
                'written as {{"tool_call": ' + _CALL + '}}.',
    "required-many": 'You must call functions, one or more. Respond in JSON format with '
                     '"tool_calls", written as {{"tool_calls": [' + _CALL + ', ...]}}.',
    "named": 'You must call the function {name}. Respond in JSON format with "tool_call", '
             'written as {{"tool_call": {{"name": "{name}", "arguments": {{...}}}}}}.',
}

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
        if self.named:
            rule = _RULES["named"].format(name=self.choice)
        else:
            rule = _RULES[self.choice + ("-many" if self.parallel else "")].format()
        return GENERIC_PROMPT.format(tools=lines, rule=rule)

    def grammar(self, request_id: str | None = None) -> GrammarSource:
        """The output grammar (see the module docstring)."""
        fmt = self.format
        tools = [t for t in self.tools if not self.named or t.function.name == self.choice]
        many = fmt.many and self.parallel and not self.named
        if fmt.envelope:
            return lark_grammar(self._envelope(tools, many), "$.tools", request_id)
        bodies = " | ".join(f"%json{json.dumps(_call_schema(t, fmt.args_key))}" for t in tools)
        call = " ".join(x for x in (lark_string(fmt.open) if fmt.open else "", "call_body",
                                    lark_string(fmt.close) if fmt.close else "") if x)
        calls = 'call ("\\n" call)*' if many else "call"
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

    def _envelope(self, tools: list[Tool], many: bool) -> str:
        """The generic style's Lark: {"response":"<answer>"} (auto only), {"tool_call":
        call} or, with parallel calls, {"tool_calls":[call,...]}. Each kind opens with a
        literal (a literal beside a %json at the same place would trip llguidance's greedy
        lexer). The answer's string may also end at EOS, unclosed: a chat model ends its
        turn with EOS (SmolLM2-135M, "What is the capital of France?" with Open WebUI's
        tools: with the string to close, 2 of 10 answers ran to max_tokens 60; with EOS
        allowed, 3 of 28 ran to 200, over three runs)."""
        bodies = " | ".join(f"%json{json.dumps(_call_schema(t, self.format.args_key))}"
                            for t in tools)
        calls = (f'{lark_string(MANY_OPEN)} call_body ("," call_body)* "]}}"' if many
                 else f'{lark_string(ONE_OPEN)} call_body "}}"')
        rules = [f"calls: {calls}", f"call_body: {bodies}"]
        if self.choice == "auto":
            close = lark_string('"}')
            rules = ["start: answer | calls", *rules,
                     f"answer: {lark_string(ANSWER_OPEN)} ANSWER_TEXT? {close}?",
                     f"ANSWER_TEXT: /{_JSON_STRING_TEXT}/"]
        else:
            rules.insert(0, "start: calls")
        return "\n".join(rules)


ANSWER_OPEN, ONE_OPEN, MANY_OPEN = '{"response":"', '{"tool_call":', '{"tool_calls":['
"""How the generic style's envelope opens: an answer, one call, several calls."""
_JSON_STRING_TEXT = (r'(?:[^"\\\x00-\x08\x0b\x0c\x0e-\x1f]'
                     r'|\\(?:["\\\/bfnrt]|u[0-9a-fA-F]{4}))+')
"""A JSON string's characters (Rust regex syntax): no quote or backslash unescaped; raw
newlines, carriage returns and tabs allowed besides their escapes (JSON wants them escaped,
but the envelope never leaves the server, and a chat model's answer breaks its lines with
the raw character: masked, it must find `\\n` instead); `/` escaped for Lark's /regex/."""


_X_GUIDANCE = {"lenient": True, "whitespace_flexible": False}
"""llguidance's options for a tool grammar: keywords it does not enforce (e.g. an unknown
`format`) are ignored rather than refusing the tool list (a chat front end sends its tools
with every message; refusing them would refuse every message), and no free whitespace: one
way to write a call (a small model given room for blanks may spend its tokens on them)."""


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
    Objects closed (`close_objects`), with llguidance's options (`_X_GUIDANCE`)."""
    params = t.function.parameters if t.function.parameters is not None else {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": t.function.name}, args_key: close_objects(params)},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": _X_GUIDANCE}


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust's regex syntax: only its
    metacharacters are escaped; `\\<` would be a word boundary there)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def history_turns(messages: Sequence[ChatMessage], style: str,
                  system_prompt: str | None) -> list[dict[str, Any]]:
    """Chat turns as dicts for the template: past tool calls and results in the style's
    form, and the generic tool prompt merged into the first system turn (or a new one).

    Native styles: `tool_calls` with arguments as objects, `tool_call_id`. Generic: a
    past call is a sentence in the assistant's content (`I call f with {...}.`) and its
    result a user turn (`f returned: ...`; consecutive results in one turn), as llama.cpp
    polyfills templates without tool roles. Not the call's own JSON: shown its past call
    in the envelope form, SmolLM2-135M called again after every result (10 of 10, with
    the result in a `tool` or a `user` turn); with the sentence it answered (10 of 10).
    """
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name (generic results)
    results: dict[str, Any] | None = None  # the generic results turn the last one opened
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            if style == "generic":
                said = " ".join(f"I call {c.function.name} with "
                                f"{_compact(c.function.arguments)}." for c in m.tool_calls)
                turn["content"] = (turn["content"] + "\n" if turn["content"] else "") + said
                names.update((c.id, c.function.name) for c in m.tool_calls)
            else:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.function.name,
                                                    "arguments": _arguments(c.function.arguments)}}
                                      for c in m.tool_calls]
        if m.role == "tool":
            if style == "generic":
                name = names.get(m.tool_call_id or "") or m.name or "The function"
                said = f"{name} returned: {m.content or ''}"
                if results is not None and turns[-1] is results:
                    results["content"] += "\n" + said
                    continue
                turn = results = {"role": "user", "content": said}
            else:
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


def _compact(arguments: str) -> str:
    """A call's arguments as compact JSON (as given where they do not parse)."""
    value = _arguments(arguments)
    if isinstance(value, str):
        return value or "{}"
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
