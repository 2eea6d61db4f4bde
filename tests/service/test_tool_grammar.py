"""The tool-call grammar (service/engine/constraints/tools.py) compiled for the default
model's tokenizer: what it allows once a call is complete."""

from __future__ import annotations

import ctypes

import msgspec
import pytest

from protocol.structured import Tool
from service.engine.constraints.compiler import GrammarCompiler
from service.engine.constraints.tools import ToolPlan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
CALL = '{"tool_call":{"name":"get_weather","arguments":{"city":"Oslo"}}}'
HERMES_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from service.worker.loader import _source, default_model_path

    folder, kw = _source(default_model_path())
    return AutoTokenizer.from_pretrained(folder, **kw)


def allowed_after(compiler: GrammarCompiler, plan: ToolPlan, text: str) -> set[int]:
    matcher = compiler.compile_sync(plan.grammar())
    ids = compiler._hf.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(ids), matcher.get_error()
    mask = (ctypes.c_uint32 * compiler.words)()
    matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), compiler.words * 4)
    return {t for t in range(compiler.vocab_size) if mask[t // 32] >> (t % 32) & 1}


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_after_one_call_only_eos_unless_parallel_calls(hf_tokenizer, choice):
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [eos])
    tools = [msgspec.convert(WEATHER, Tool)]
    one = ToolPlan.make(tools, choice, "generic")
    assert allowed_after(compiler, one, CALL) == {eos}
    many = ToolPlan.make(tools, choice, "generic", parallel=True)
    calls = '{"tool_calls":[' + CALL[len('{"tool_call":'):-1]
    after = allowed_after(compiler, many, calls)
    assert eos not in after and "," in {hf_tokenizer.decode([t]) for t in after}
    assert allowed_after(compiler, many, calls + "]}") == {eos}
    assert '"tool_calls"' in many.system_prompt() and '"tool_calls"' not in one.system_prompt()
    hermes = ToolPlan.make(tools, choice, "hermes")
    assert allowed_after(compiler, hermes, HERMES_CALL) == {eos}
    after = allowed_after(compiler, ToolPlan.make(tools, choice, "hermes", parallel=True),
                          HERMES_CALL)
    assert eos in after and len(after) > 1  # a newline may start the next call


def test_generic_auto_is_an_answer_or_a_call_in_json(hf_tokenizer):
    """generic + auto: `{"response": ...}` or `{"tool_call": ...}`; never free text."""
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [eos])
    tools = [msgspec.convert(WEATHER, Tool)]
    auto = ToolPlan.make(tools, "auto", "generic")
    first = {hf_tokenizer.decode([t]) for t in allowed_after(compiler, auto, "")}
    assert first and all(x.lstrip().startswith("{") or "{".startswith(x) for x in first)
    assert allowed_after(compiler, auto, '{"response":"Oslo is cold."}') == {eos}
    after = {hf_tokenizer.decode([t]) for t in allowed_after(compiler, auto, '{"')}
    assert any(x.startswith("response") or "response".startswith(x) for x in after)
    assert any(x.startswith("tool") or "tool".startswith(x) for x in after)
    required = ToolPlan.make(tools, "required", "generic")
    after = {hf_tokenizer.decode([t]) for t in allowed_after(compiler, required, '{"')}
    assert not any(x.startswith("r") for x in after)


def test_integers_without_bounds_get_fifteen_digits_at_most():
    from service.engine.constraints.grammar import INTEGER_BOUND, close_objects

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "k": {"type": "integer", "minimum": 0},
        "e": {"type": "integer", "enum": [1, 2]}}}
    out = close_objects(schema)
    assert out["properties"]["n"] == {"type": "integer", "minimum": -INTEGER_BOUND,
                                      "maximum": INTEGER_BOUND}
    assert out["properties"]["k"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_BOUND}
    assert out["properties"]["e"] == {"type": "integer", "enum": [1, 2]}
    assert "minimum" not in schema["properties"]["n"]
    assert len(str(INTEGER_BOUND)) == 15


def test_numbers_get_ten_digits_after_the_point_unless_their_schema_says_more():
    from service.engine.constraints.grammar import FRACTION_DIGITS, INTEGER_BOUND, close_objects

    step = 10.0 ** -FRACTION_DIGITS
    assert close_objects({"type": "number"}) == {
        "type": "number", "minimum": -INTEGER_BOUND, "maximum": INTEGER_BOUND, "multipleOf": step}
    assert close_objects({"type": "number", "minimum": 0, "maximum": 10}) == {
        "type": "number", "minimum": 0, "maximum": 10, "multipleOf": step}
    assert close_objects({"type": "number", "multipleOf": 0.5})["multipleOf"] == 0.5
    # a bound finer than the step keeps the schema's own precision
    assert "multipleOf" not in close_objects({"type": "number", "exclusiveMinimum": 1e-12})
    assert "multipleOf" in close_objects({"type": "number", "exclusiveMaximum": 1e20})
    assert close_objects({"type": "number", "const": 2.5}) == {"type": "number", "const": 2.5}


@pytest.mark.parametrize(("schema", "text", "valid"), [
    ({"type": "number", "minimum": 0, "maximum": 10}, "7." + "1" * 10, True),
    ({"type": "number", "minimum": 0, "maximum": 10}, "7." + "1" * 11, False),
    ({"type": "number", "minimum": 0, "maximum": 10}, "0.5", True),
    ({"type": "number"}, "-3.25", True),
    ({"type": "number"}, "-" + "9" * 15, True),
    ({"type": "number"}, "9" * 14 + ".5", True),
    ({"type": "number"}, "9" * 16, False),
    ({"type": "number", "exclusiveMinimum": 0}, "0.0000000001", True),
])
def test_number_bounds_compile_and_hold_in_the_matcher(hf_tokenizer, schema, text, valid):
    """What llguidance makes of the closed schema, fed one character at a time."""
    import llguidance

    from service.engine.constraints.grammar import GrammarSource, close_objects

    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [eos])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        close_objects(schema), overrides={"whitespace_flexible": False})
    matcher = compiler.compile_sync(GrammarSource(grammar, "$"))
    fed = all(matcher.consume_tokens(hf_tokenizer.encode(ch, add_special_tokens=False))
              for ch in text)
    assert (fed and matcher.is_accepting()) == valid, matcher.get_error()


def test_generic_answer_may_end_at_eos_and_escapes_are_json(hf_tokenizer):
    """The answer's string may end unclosed at EOS (a chat model ends its turn so); closed,
    only `}` and then EOS; inside it only JSON's escapes."""
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [eos])
    auto = ToolPlan.make([msgspec.convert(WEATHER, Tool)], "auto", "generic")
    after = allowed_after(compiler, auto, '{"response":"It is \\"cold\\" \\u00e9/\\/\\n')
    assert eos in after and len(after) > 1000
    assert allowed_after(compiler, auto, '{"response":"Cold."}') == {eos}
    assert eos in allowed_after(compiler, auto, '{"response":"Two\nlines\tand a tab')
    matcher = compiler.compile_sync(auto.grammar())
    bad = compiler._hf.encode('{"response":"a\\q', add_special_tokens=False)
    assert not matcher.consume_tokens(bad)
