"""Tool calls parsed out of a streamed completion (service/engine/constraints/tool_parser.py)."""

from __future__ import annotations

import json
import random

from service.engine.constraints.tool_parser import ToolCallParser
from service.engine.constraints.tools import FORMATS

TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" x", '
             '"days": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>\n{"name":"f","arguments":{}}'
             '\n</tool_call>')


def feed_in_pieces(parser: ToolCallParser, text: str, rng: random.Random):
    out, pieces, i = "", [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        t, d = parser.feed(text[i:j])
        out, pieces, i = out + t, pieces + d, j
    t, d = parser.finish()
    return out + t, pieces + d


def test_calls_split_anywhere_give_the_same_calls():
    rng = random.Random(1)
    for _ in range(300):
        p = ToolCallParser(FORMATS["hermes"])
        text, pieces = feed_in_pieces(p, TWO_CALLS, rng)
        assert text == "" and p.is_calls
        assert [c.function.name for c in p.calls] == ["get_weather", "f"]
        assert json.loads(p.calls[0].function.arguments) == {"city": 'Paris "}" x',
                                                             "days": [1, {"a": 2}]}
        assert p.calls[1].function.arguments == "{}"
        for k, call in enumerate(p.calls):  # the streamed pieces add up to each call
            mine = [d for d in pieces if d.index == k]
            assert mine[0].id == call.id and mine[0].function.name == call.function.name
            assert "".join(d.function.arguments for d in mine) == call.function.arguments
            assert all(d.id is None for d in mine[1:])


def test_plain_text_passes_through():
    rng = random.Random(2)
    for text in ("  <tools are fun>", "Hello <tool_call", "", "{not a call}"):
        p = ToolCallParser(FORMATS["hermes"])
        out, pieces = feed_in_pieces(p, text, rng)
        assert out == text and pieces == [] and p.calls == []


def test_llama_json_form():
    p = ToolCallParser(FORMATS["llama"])
    out, pieces = feed_in_pieces(p, '{"name": "f", "parameters": {"a": 1}}', random.Random(3))
    assert out == "" and [(c.function.name, c.function.arguments) for c in p.calls] == \
        [("f", '{"a": 1}')]


def test_a_call_cut_inside_its_arguments_is_reported_as_streamed():
    """max_tokens inside the arguments: the call, with the arguments streamed so far."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    for seed in range(20):
        p = ToolCallParser(FORMATS["hermes"])
        out, pieces = feed_in_pieces(p, text, random.Random(seed))
        assert out == "" and p.is_calls and p.partial
        assert [(c.function.name, c.function.arguments) for c in p.calls] == \
            [("f", '{"a": [1, 2')]
        assert "".join(d.function.arguments for d in pieces) == '{"a": [1, 2'
        assert pieces[0].id == p.calls[0].id


def test_a_call_cut_before_its_name_is_returned_as_text():
    """Nothing was streamed of it: its text comes back as plain text, after complete calls."""
    done = '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n'
    for cut in ('<tool_call>\n{"na', '<tool_call>\n{"name": "get_we'):
        p = ToolCallParser(FORMATS["hermes"])
        out, _ = feed_in_pieces(p, cut, random.Random(5))
        assert out == cut and p.calls == [] and not p.partial
        p = ToolCallParser(FORMATS["hermes"])
        out, _ = feed_in_pieces(p, done + cut, random.Random(6))
        assert out.lstrip() == cut and [c.function.name for c in p.calls] == ["f"]
        assert not p.partial


def test_a_call_cut_in_its_closing_text_is_complete():
    p = ToolCallParser(FORMATS["hermes"])
    out, _ = feed_in_pieces(p, '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_',
                            random.Random(7))
    assert out == "" and not p.partial and p.calls[0].function.arguments == '{"a":1}'


def test_generic_history_writes_calls_and_results_as_sentences():
    """The generic style's past calls are sentences and their results one user turn
    (consecutive results merged); a native style keeps `tool_calls` and `tool` turns."""
    from protocol import ChatMessage
    from protocol.structured import FunctionCall, ToolCall
    from service.engine.constraints.tools import history_turns

    calls = [ToolCall(id="call_a", function=FunctionCall("get_weather", '{"city": "Oslo"}')),
             ToolCall(id="call_b", function=FunctionCall("now", ""))]
    messages = [ChatMessage("user", "Weather and time?"),
                ChatMessage("assistant", None, tool_calls=calls),
                ChatMessage("tool", "cold", tool_call_id="call_a"),
                ChatMessage("tool", "noon", tool_call_id="call_b"),
                ChatMessage("user", "Thanks")]
    turns = history_turns(messages, "generic", "TOOLS")
    assert turns == [
        {"role": "system", "content": "TOOLS"},
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": 'I call get_weather with {"city":"Oslo"}. I call now with {}.'},
        {"role": "user", "content": "get_weather returned: cold\nnow returned: noon"},
        {"role": "user", "content": "Thanks"}]
    native = history_turns(messages, "hermes", None)
    assert [t["role"] for t in native] == ["user", "assistant", "tool", "tool", "user"]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2]["tool_call_id"] == "call_a"
