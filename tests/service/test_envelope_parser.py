"""The generic tool style's envelope parsed as it streams
(service/engine/constraints/envelope_parser.py)."""

from __future__ import annotations

import json
import random

from service.engine.constraints.envelope_parser import EnvelopeParser, tool_parser
from service.engine.constraints.tools import FORMATS
from tests.service.test_tool_parser import feed_in_pieces

ANSWER = 'Caf\u00e9 "quoted" \\ back\nslash / tab\t and \U0001F600 done'


def test_the_generic_format_gets_the_envelope_parser():
    assert isinstance(tool_parser(FORMATS["generic"]), EnvelopeParser)
    assert not isinstance(tool_parser(FORMATS["hermes"]), EnvelopeParser)


def test_an_answer_streams_decoded_split_anywhere():
    for ascii_only in (True, False):  # \uXXXX escapes (a surrogate pair) or raw characters
        text = json.dumps({"response": ANSWER}, separators=(",", ":"), ensure_ascii=ascii_only)
        assert ("\\ud83d\\ude00" in text) is ascii_only
        for seed in range(200):
            p = EnvelopeParser(FORMATS["generic"])
            out, pieces = feed_in_pieces(p, text, random.Random(seed))
            assert out == ANSWER and pieces == [] and not p.is_calls and p.calls == []


def test_one_call_and_parallel_calls_split_anywhere():
    one = '{"tool_call":{"name":"get_weather","arguments":{"city":"Paris \\"}]\\" x"}}}'
    many = ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo","days":[1,{"a":2}]}},'
            '{"name":"f","arguments":{}}]}')
    for text, names in ((one, ["get_weather"]), (many, ["get_weather", "f"])):
        for seed in range(200):
            p = EnvelopeParser(FORMATS["generic"])
            out, pieces = feed_in_pieces(p, text, random.Random(seed))
            assert out == "" and p.is_calls and not p.partial
            assert [c.function.name for c in p.calls] == names
            calls = json.loads(text)
            calls = [calls["tool_call"]] if "tool_call" in calls else calls["tool_calls"]
            for k, (call, want) in enumerate(zip(p.calls, calls)):
                assert json.loads(call.function.arguments) == want["arguments"]
                mine = [d for d in pieces if d.index == k]
                assert mine[0].id == call.id and mine[0].function.name == call.function.name
                assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments


def test_cut_completions_lose_nothing():
    rng = random.Random(9)
    # cut before the kind is known, or inside a call's name: the text as generated
    for cut in ('{"res', '{"tool_call":{"na', '{"tool_calls":[{"name":"get_we'):
        p = EnvelopeParser(FORMATS["generic"])
        out, _ = feed_in_pieces(p, cut, rng)
        assert out == cut and p.calls == [] and not p.partial
    # cut inside the arguments: the call as streamed, marked partial
    p = EnvelopeParser(FORMATS["generic"])
    out, pieces = feed_in_pieces(p, '{"tool_call":{"name":"f","arguments":{"a":[1,2', rng)
    assert out == "" and p.partial and p.calls[0].function.arguments == '{"a":[1,2'
    # an answer cut inside an escape ends with the escape's raw text
    p = EnvelopeParser(FORMATS["generic"])
    out, _ = feed_in_pieces(p, '{"response":"ab\\u00', rng)
    assert out == "ab\\u00"
    # text that is not an envelope passes through unchanged
    for text in ("Hello", "  {not json", ""):
        p = EnvelopeParser(FORMATS["generic"])
        out, pieces = feed_in_pieces(p, text, rng)
        assert out == text and pieces == []


def test_raw_newlines_and_tabs_pass_as_they_are():
    p = EnvelopeParser(FORMATS["generic"])
    out, _ = feed_in_pieces(p, '{"response":"one\ntwo\tthree\\nfour', random.Random(4))
    assert out == "one\ntwo\tthree\nfour"


def test_lone_surrogates_become_replacement_characters():
    p = EnvelopeParser(FORMATS["generic"])
    out, _ = feed_in_pieces(p, '{"response":"a\\ud83dxb\\ude00c"}', random.Random(3))
    assert out == "a\ufffdxb\ufffdc"
