"""decode_client_frame: bad frames become InvalidRequest with the field's path, and nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    Cancel,
    Generate,
    InvalidRequest,
    Ping,
    SamplingParams,
    decode_client_frame,
    encode,
)


def gen(**fields: Any) -> str:
    """A generate frame with id "r1" and a prompt, overridden or extended by `fields`."""
    frame: dict[str, Any] = {"type": "generate", "id": "r1", "prompt": "Hi"}
    frame.update(fields)
    return json.dumps({k: v for k, v in frame.items() if v is not _DROP})


_DROP = object()

# (frame, param, request_id)
BAD_FRAMES: list[tuple[str | bytes, str | None, str | None]] = [
    (b"\xff\xfe\x00garbage", None, None),
    (b"", None, None),
    ("not json", None, None),
    ('{"type": "generate", "id": "r1", ', None, None),
    ("[1, 2, 3]", None, None),
    ('"generate"', None, None),
    ("null", None, None),
    ('{"id": "r1", "prompt": "Hi"}', "$.type", "r1"),
    ('{"type": "fly", "id": "r1"}', "$.type", "r1"),
    ('{"type": 7, "id": "r1"}', "$.type", "r1"),
    (gen(params={"max_tokens": "5"}), "$.params.max_tokens", "r1"),
    (gen(params={"max_tokens": 0}), "$.params.max_tokens", "r1"),
    (gen(params={"max_tokens": 2.5}), "$.params.max_tokens", "r1"),
    (gen(params={"temperature": -1}), "$.params.temperature", "r1"),
    (gen(params={"top_p": 0}), "$.params.top_p", "r1"),
    (gen(params={"top_p": 1.5}), "$.params.top_p", "r1"),
    (gen(params={"top_k": -1}), "$.params.top_k", "r1"),
    (gen(params={"min_p": 1.1}), "$.params.min_p", "r1"),
    (gen(params={"seed": "x"}), "$.params.seed", "r1"),
    (gen(params={"stop": [str(i) for i in range(9)]}), "$.params.stop", "r1"),
    (gen(params={"stop": "END"}), "$.params.stop", "r1"),
    (gen(params={"stop": ["a", ""]}), "$.params.stop[1]", "r1"),
    (gen(params={"stop_token_ids": [1, -2]}), "$.params.stop_token_ids[1]", "r1"),
    (gen(params={"ignore_eos": "yes"}), "$.params.ignore_eos", "r1"),
    (gen(params={"ttft_slo_ms": 0}), "$.params.ttft_slo_ms", "r1"),
    ('{"type": "generate", "id": "r1", "prompt": "Hi", "params": {"temperature": 1e999}}',
     "$.params.temperature", "r1"),
    (gen(params=[1]), "$.params", "r1"),
    # every number is bounded (issue 14): nothing a client sends overflows engine arithmetic
    (gen(params={"priority": int("9" * 400)}), "$.params.priority", "r1"),
    (gen(params={"priority": -(2 ** 63) - 1}), "$.params.priority", "r1"),
    (gen(params={"seed": 2 ** 63}), "$.params.seed", "r1"),
    (gen(params={"max_tokens": 2 ** 31}), "$.params.max_tokens", "r1"),
    (gen(params={"top_k": 2 ** 31}), "$.params.top_k", "r1"),
    (gen(params={"temperature": 100.5}), "$.params.temperature", "r1"),
    (gen(params={"ttft_slo_ms": 1e10}), "$.params.ttft_slo_ms", "r1"),
    (gen(params={"stop_token_ids": [2 ** 31]}), "$.params.stop_token_ids[0]", "r1"),
    (gen(params={"stop_token_ids": list(range(257))}), "$.params.stop_token_ids", "r1"),
    (gen(prompt=_DROP, prompt_token_ids=[2 ** 31]), "$.prompt_token_ids[0]", "r1"),
    (gen(messages=[{"role": "user", "content": "Hi"}]), None, "r1"),
    (gen(prompt=_DROP), None, "r1"),
    (gen(prompt=None), None, "r1"),
    (gen(id="x" * 129), "$.id", None),
    (gen(id=""), "$.id", None),
    (gen(id=5), "$.id", None),
    (gen(id=_DROP), "$.id", None),
    (gen(prompt=_DROP, messages=[{"content": "Hi"}]), "$.messages[0].role", "r1"),
    (gen(prompt=_DROP, messages=[{"role": "user", "content": 3}]), "$.messages[0].content", "r1"),
    (gen(prompt=_DROP, messages=[]), "$.messages", "r1"),
    (gen(prompt=_DROP, prompt_token_ids=[1, -1]), "$.prompt_token_ids[1]", "r1"),
    (gen(prompt=_DROP, prompt_token_ids=["1"]), "$.prompt_token_ids[0]", "r1"),
    ('{"type": "cancel"}', "$.id", None),
    ('{"type": "ping", "t": "now"}', "$.t", None),
    ("[" * 100_000, None, None),
    ('{"id": "r1", "x": ' + "[" * 100_000, None, None),
    ('{"type": "generate", "id": "\\ud800", "prompt": "x"}', None, None),
]


@pytest.mark.parametrize(("frame", "param", "request_id"), BAD_FRAMES, ids=lambda v: repr(v)[:60])
def test_bad_frame_is_invalid_request_naming_the_field(
    frame: str | bytes, param: str | None, request_id: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_client_frame(frame)
    exc = info.value
    assert (exc.code, exc.param, exc.request_id) == ("invalid_request", param, request_id)
    assert exc.message
    # The server sends exactly this frame back: it must encode.
    assert json.loads(encode(exc.to_frame()))["id"] == request_id


def test_non_text_input_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        decode_client_frame(12)  # type: ignore[arg-type]


def test_valid_frames_decode_from_text_and_bytes() -> None:
    assert decode_client_frame('{"type":"cancel","id":"r1"}') == Cancel(id="r1")
    assert decode_client_frame(b'{"type":"ping"}') == Ping()
    assert decode_client_frame(bytearray(b'{"type":"ping","t":2}')) == Ping(t=2.0)
    msg = decode_client_frame(gen(prompt=_DROP, prompt_token_ids=[]))
    assert msg == Generate(id="r1", prompt_token_ids=[])
    assert msg.params == SamplingParams()


def test_boundary_values_are_accepted() -> None:
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 1.0}
    params["stop"] = [str(i) for i in range(8)]
    msg = decode_client_frame(gen(id="x" * 128, params=params))
    assert isinstance(msg, Generate)
    assert (msg.params.top_p, msg.params.min_p, len(msg.params.stop)) == (1.0, 1.0, 8)
    edges = {"max_tokens": 2 ** 31 - 1, "top_k": 2 ** 31 - 1, "temperature": 100.0,
             "priority": -(2 ** 63), "seed": 2 ** 63 - 1, "ttft_slo_ms": 1e9,
             "stop_token_ids": [2 ** 31 - 1] * 256}
    msg = decode_client_frame(gen(params=edges))
    assert isinstance(msg, Generate) and msg.params.priority == -(2 ** 63)


# --- fuzzing: nothing but InvalidRequest may escape ---------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)

param_names = st.sampled_from(sorted(SamplingParams.__struct_fields__) + ["bogus"])

frame_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "cancel", "ping", "pong", "nope"]) | json_values},
    optional={
        "id": st.text(max_size=130) | json_values,
        "prompt": st.text(max_size=10) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values}),
            max_size=3,
        )
        | json_values,
        "prompt_token_ids": st.lists(st.integers(), max_size=4) | json_values,
        "params": st.dictionaries(param_names, json_values, max_size=4) | json_values,
        "t": json_values,
    },
)


def check_decode(data: str | bytes) -> None:
    try:
        msg = decode_client_frame(data)
    except InvalidRequest as exc:
        assert exc.param is None or exc.param.startswith("$")
        assert exc.request_id is None or 1 <= len(exc.request_id) <= 128
        encode(exc.to_frame())
    else:
        assert decode_client_frame(encode(msg)) == msg


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    check_decode(data)


@FUZZ
@given(st.text(max_size=200))
def test_random_text_never_raises_anything_else(data: str) -> None:
    check_decode(data)


@FUZZ
@given(json_values)
def test_random_json_never_raises_anything_else(value: Any) -> None:
    check_decode(json.dumps(value))


@FUZZ
@given(frame_like)
def test_frame_like_json_never_raises_anything_else(value: dict[str, Any]) -> None:
    check_decode(json.dumps(value))
