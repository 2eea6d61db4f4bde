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
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'


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
    after = allowed_after(compiler, many, CALL)
    assert eos in after and len(after) > 1  # a newline may start the next call
    assert "one or more calls" in many.system_prompt()
    assert "one or more" not in one.system_prompt()


def test_integers_without_bounds_get_fifteen_digits_at_most():
    from service.engine.constraints.grammar import INTEGER_BOUND, close_objects

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "k": {"type": "integer", "minimum": 0},
        "x": {"type": "number"}}}
    out = close_objects(schema)
    assert out["properties"]["n"] == {"type": "integer", "minimum": -INTEGER_BOUND,
                                      "maximum": INTEGER_BOUND}
    assert out["properties"]["k"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_BOUND}
    assert out["properties"]["x"] == {"type": "number"} and "minimum" not in schema["properties"]["n"]
    assert len(str(INTEGER_BOUND)) == 15
