"""Every frame round-trips through JSON, PROTOCOL.md's examples included."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from protocol import (
    InvalidRequest,
    Accepted,
    Cancel,
    ChatMessage,
    Delta,
    Done,
    Error,
    Generate,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    SamplingParams,
    Timings,
    Usage,
    decode_client_frame,
    decode_server_frame,
    encode,
)

# The JSON examples of PROTOCOL.md, verbatim.
CLIENT_EXAMPLES = [
    '{"type": "ping", "t": 1.5}',
    """{"type": "generate", "id": "r1",
 "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "Hi"}],
 "params": {"max_tokens": 256, "temperature": 0.0}}""",
    '{"type": "cancel", "id": "r1"}',
]
SERVER_EXAMPLES = [
    '{"type": "hello", "protocol": 1, "model": "SmolLM2-135M-Instruct", "max_model_len": 8192}',
    '{"type": "pong", "t": 1.5}',
    '{"type": "accepted", "id": "r1", "prompt_tokens": 37}',
    '{"type": "delta", "id": "r1", "index": 0, "text": "The", "token_ids": [504]}',
    """{"type": "done", "id": "r1", "finish_reason": "stop",
 "usage": {"prompt_tokens": 37, "completion_tokens": 8, "total_tokens": 45, "cached_tokens": 0},
 "timings": {"queue_ms": 1.2, "ttft_ms": 48.0, "tpot_ms": 23.2, "e2e_ms": 210.5, "preemptions": 0}}""",
    """{"type": "error", "id": "r1", "code": "context_length_exceeded", "param": "$.params.max_tokens",
 "message": "prompt (9000 tokens) + max_tokens (256) exceeds the context (8192)", "retryable": false}""",
]


def assert_shows(actual: Any, expected: Any, path: str = "$") -> None:
    """Every key and value of `expected` is in `actual` (objects may have more keys)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing"
            assert_shows(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_shows(a, e, f"{path}[{i}]")
    else:
        assert actual == expected and type(actual) is type(expected), path


@pytest.mark.parametrize("example", CLIENT_EXAMPLES)
def test_client_examples_round_trip_with_every_field_shown(example: str) -> None:
    msg = decode_client_frame(example)
    assert decode_client_frame(encode(msg)) == msg
    assert_shows(json.loads(encode(msg)), json.loads(example))


@pytest.mark.parametrize("example", SERVER_EXAMPLES)
def test_server_examples_round_trip_exactly(example: str) -> None:
    msg = decode_server_frame(example)
    assert json.loads(encode(msg)) == json.loads(example)


def test_generate_example_decodes_to_these_values() -> None:
    msg = decode_client_frame(CLIENT_EXAMPLES[1])
    assert msg == Generate(
        id="r1",
        messages=[ChatMessage("system", "..."), ChatMessage("user", "Hi")],
        params=SamplingParams(max_tokens=256, temperature=0.0),
    )


ALL_FIELDS_PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    stop=("\n\n", "END"),
    stop_token_ids=(2, 3),
    ignore_eos=True,
    priority=-1,
    ttft_slo_ms=250.0,
)

CLIENT_MESSAGES = [
    Generate(id="a", prompt="Once upon", params=ALL_FIELDS_PARAMS),
    Generate(id="b" * 128, prompt_token_ids=[1, 2, 3]),
    Generate(id="c", prompt_token_ids=[]),
    Generate(id="d", messages=[ChatMessage("user", "héllo 🌍")]),
    Cancel(id="a"),
    Ping(t=12.25),
    Ping(),
]

SERVER_MESSAGES = [
    Hello(protocol=1, model="m", max_model_len=2048),
    Pong(t=3.0),
    Pong(),
    Accepted(id="a", prompt_tokens=5),
    Delta(id="a", index=3, text="é🌍", token_ids=[10, 11, 12]),
    Done(
        id="a",
        finish_reason="cancelled",
        usage=Usage(prompt_tokens=5, completion_tokens=0, total_tokens=5, cached_tokens=4),
        timings=Timings(queue_ms=0.5),
    ),
    Error(id=None, code="invalid_request", param=None, message="bad", retryable=False),
    Error(
        id="a", code="overloaded", param=None, message="full", retryable=True, retry_after_ms=250
    ),
    Done(
        id="b",
        finish_reason="length",
        usage=Usage(prompt_tokens=40, completion_tokens=2, total_tokens=42, cached_tokens=32,
                    disk_cached_tokens=16),
        timings=Timings(),
    ),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=repr)
def test_client_message_round_trip(msg: msgspec.Struct) -> None:
    assert decode_client_frame(encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=repr)
def test_server_message_round_trip(msg: msgspec.Struct) -> None:
    assert decode_server_frame(encode(msg)) == msg


def test_always_present_fields_are_encoded() -> None:
    error = json.loads(encode(SERVER_MESSAGES[6]))
    assert error == {
        "type": "error",
        "id": None,
        "code": "invalid_request",
        "param": None,
        "message": "bad",
        "retryable": False,
    }
    done = json.loads(encode(SERVER_MESSAGES[5]))
    assert done["usage"]["cached_tokens"] == 4
    assert done["timings"] == {
        "queue_ms": 0.5,
        "ttft_ms": None,
        "tpot_ms": None,
        "e2e_ms": None,
        "preemptions": 0,
    }


def test_absent_prompt_forms_and_default_params_are_omitted() -> None:
    assert json.loads(encode(Generate(id="a", prompt="x"))) == {
        "type": "generate",
        "id": "a",
        "prompt": "x",
    }


def test_sampling_params_defaults_are_the_protocol_table() -> None:
    # max_tokens, temperature, top_p, top_k, min_p: None = unset, filled from the model's
    # generation config by the engine (service/engine/sampling_defaults.py); max_tokens else 256
    assert msgspec.structs.asdict(SamplingParams()) == {
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "seed": None,
        "stop": (),
        "stop_token_ids": (),
        "ignore_eos": False,
        "priority": 0,
        "ttft_slo_ms": None,
        # not in the protocol's table: the OpenAI HTTP routes and in-process callers only
        # (the WebSocket route refuses them, tests/integration/test_server.py)
        "logprobs": None,
        "prompt_logprobs": None,
        # PROTOCOL.md's penalties and constraints (issue 48); repetition_penalty unset:
        # the generation config's, else 1.0
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": None,
        "logit_bias": None,
        "min_tokens": 0,
        # PROTOCOL.md's structured output (issue 48): no constraint by default
        "response_format": None,
        "structured": None,
    }


def test_logit_bias_decodes_from_string_keys_and_is_range_checked() -> None:
    msg = decode_client_frame(json.dumps({"type": "generate", "id": "a", "prompt": "x",
                                          "params": {"logit_bias": {"12": -3, "7": 100}}}))
    assert msg.params.logit_bias == {12: -3.0, 7: 100.0}
    for bias, path in (({"-1": 1}, "$.params.logit_bias"), ({"1": 101}, "$.params.logit_bias"),
                       ({"x": 1}, "$.params.logit_bias")):
        with pytest.raises(ProtocolError) as e:
            decode_client_frame(json.dumps({"type": "generate", "id": "a", "prompt": "x",
                                            "params": {"logit_bias": bias}}))
        assert e.value.param.startswith(path), e.value.param
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                        ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
                        ("min_tokens", -1)):
        with pytest.raises(ProtocolError) as e:
            decode_client_frame(json.dumps({"type": "generate", "id": "a", "prompt": "x",
                                            "params": {name: value}}))
        assert e.value.param == f"$.params.{name}"


def test_structured_params_decode_and_refuse_bad_shapes() -> None:
    msg = decode_client_frame('{"type": "generate", "id": "a", "messages": [{"role": "user", '
                              '"content": "x"}], "params": {"response_format": {"type": '
                              '"json_schema", "json_schema": {"name": "p", "schema": '
                              '{"type": "object"}}}}, "tools": [{"type": "function", '
                              '"function": {"name": "f"}}], "tool_choice": "required"}')
    assert msg.params.response_format.json_schema.schema == {"type": "object"}
    assert msg.tools[0].function.name == "f" and msg.tool_choice == "required"
    for params, path in (('{"structured": {"regex": "a", "choice": ["b"]}}', "$.params.structured"),
                         ('{"structured": {}}', "$.params.structured"),
                         ('{"response_format": {"type": "json_schema"}}', "$.params.response_format"),
                         ('{"response_format": {"type": "json_object"}, "structured": '
                          '{"regex": "a"}}', "$.params")):
        with pytest.raises(InvalidRequest) as e:
            decode_client_frame('{"type": "generate", "id": "a", "prompt": "x", "params": '
                                + params + "}")
        assert e.value.param == path, (params, e.value.param)


def test_sampling_params_are_frozen_and_hashable() -> None:
    msg = decode_client_frame(
        '{"type": "generate", "id": "a", "prompt": "x", "params": {"stop": ["a"], "stop_token_ids": [1]}}'
    )
    assert isinstance(msg, Generate)
    params = msg.params
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop=("a",), stop_token_ids=(1,)))


def test_generate_needs_exactly_one_prompt_form_in_python_too() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Generate(id="a")
    with pytest.raises(ValueError, match="exactly one"):
        Generate(id="a", prompt="x", prompt_token_ids=[1])


def test_unknown_fields_are_ignored() -> None:
    msg = decode_client_frame(
        '{"type": "cancel", "id": "r1", "future": {"x": 1}}'
    )
    assert msg == Cancel(id="r1")
    assert decode_server_frame(
        '{"type": "accepted", "id": "r1", "prompt_tokens": 3, "queue_position": 9}'
    ) == Accepted(id="r1", prompt_tokens=3)


def test_disk_cached_tokens_is_sent_only_by_a_server_with_a_disk_tier() -> None:
    plain = Usage(prompt_tokens=5, completion_tokens=1, total_tokens=6, cached_tokens=4)
    assert "disk_cached_tokens" not in json.loads(encode(plain))
    tiered = Usage(prompt_tokens=5, completion_tokens=1, total_tokens=6, cached_tokens=4,
                   disk_cached_tokens=0)
    assert json.loads(encode(tiered))["disk_cached_tokens"] == 0
    assert msgspec.json.decode(encode(plain), type=Usage).disk_cached_tokens is msgspec.UNSET


def test_usage_repr_leaves_out_an_absent_disk_count() -> None:
    """A Done printed by a client shows the counts, never msgspec's UNSET placeholder."""
    plain = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)
    assert repr(plain) == "Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7, cached_tokens=0)"
    tiered = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7, cached_tokens=4,
                   disk_cached_tokens=0)
    assert repr(tiered).endswith("cached_tokens=4, disk_cached_tokens=0)")
    assert "UNSET" not in str(plain)
