"""Property-based tests of the decoder with well-shaped frames and random field values
(issue 8): any frame either decodes into a value inside every documented range, or
raises InvalidRequest naming a JSON path; nothing else, ever. test_protocol_codec.py
covers random bytes, text and JSON; here the frames look right and the values are hostile
(huge and negative numbers, wrong types, lone surrogates, ids at the length limit,
duplicate keys, deep nesting inside fields)."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (MAX_ID_LENGTH, MAX_STOP_STRINGS, Cancel, Generate, InvalidRequest, Ping,
                      decode_client_frame, encode)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

big_ints = st.integers(-2**80, 2**80) | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63,
                                                         2**64 - 1, 2**64, -2**63 - 1])
floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-300, 1.0, 1.0000001, 1e308])
strings = st.text(max_size=12) | st.sampled_from(["", "\ud800", "\x00", "é" * 129])
scalars = st.none() | st.booleans() | big_ints | floats | strings
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)

ids = st.text(min_size=0, max_size=MAX_ID_LENGTH + 2) | anything
params = st.fixed_dictionaries({}, optional={
    "max_tokens": big_ints | anything, "temperature": floats | big_ints | anything,
    "top_p": floats | anything, "top_k": big_ints | anything, "min_p": floats | anything,
    "seed": big_ints | anything,
    "stop": st.lists(strings, max_size=MAX_STOP_STRINGS + 2) | anything,
    "stop_token_ids": st.lists(big_ints, max_size=4) | anything,
    "ignore_eos": st.booleans() | anything, "priority": big_ints | anything,
    "ttft_slo_ms": floats | st.none() | anything, "unknown_field": anything,
}) | anything
messages = st.lists(st.fixed_dictionaries({}, optional={"role": strings | anything,
                                                         "content": strings | anything}),
                    max_size=3) | anything
generate = st.fixed_dictionaries({"type": st.just("generate"), "id": ids}, optional={
    "prompt": strings | anything, "messages": messages,
    "prompt_token_ids": st.lists(big_ints, max_size=4) | anything, "params": params})
cancel = st.fixed_dictionaries({"type": st.just("cancel"), "id": ids})
ping = st.fixed_dictionaries({"type": st.just("ping")}, optional={"t": floats | anything})


def _to_json(value: dict[str, Any]) -> str:
    # ensure_ascii keeps lone surrogates as \ud800 escapes, as a hostile client may send
    return json.dumps(value, ensure_ascii=True)


def check(data: str | bytes) -> None:
    """The property: a typed error, or a value inside every documented range."""
    try:
        msg = decode_client_frame(data)
    except InvalidRequest as exc:
        assert exc.code == "invalid_request"
        assert exc.param is None or exc.param.startswith("$"), exc.param
        assert exc.request_id is None or 1 <= len(exc.request_id) <= MAX_ID_LENGTH
        encode(exc.to_frame())  # the error frame itself always encodes
        return
    if isinstance(msg, (Generate, Cancel)):
        assert isinstance(msg.id, str) and 1 <= len(msg.id) <= MAX_ID_LENGTH
    if isinstance(msg, Ping):
        assert msg.t is None or math.isfinite(msg.t)
    if isinstance(msg, Generate):
        forms = [msg.messages, msg.prompt, msg.prompt_token_ids]
        assert sum(f is not None for f in forms) == 1
        if msg.messages is not None:
            # content may be None (an assistant turn that made tool calls; the engine reads "")
            assert msg.messages and all(isinstance(m.role, str)
                                        and (m.content is None or isinstance(m.content, str))
                                        for m in msg.messages)
        if msg.prompt_token_ids is not None:
            assert all(isinstance(t, int) and t >= 0 for t in msg.prompt_token_ids)
        p = msg.params
        assert p.max_tokens is None or (isinstance(p.max_tokens, int) and p.max_tokens >= 1)
        # None: unset, the server's default (the model's generation config) applies
        assert p.temperature is None or (math.isfinite(p.temperature) and p.temperature >= 0)
        assert p.top_p is None or 0 < p.top_p <= 1
        assert p.min_p is None or 0 <= p.min_p <= 1
        assert p.top_k is None or (isinstance(p.top_k, int) and not isinstance(p.top_k, bool)
                                   and p.top_k >= 0)
        assert p.seed is None or isinstance(p.seed, int)
        assert len(p.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in p.stop)
        assert all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids)
        assert isinstance(p.ignore_eos, bool) and isinstance(p.priority, int)
        assert p.ttft_slo_ms is None or (math.isfinite(p.ttft_slo_ms) and p.ttft_slo_ms > 0)
    assert decode_client_frame(encode(msg)) == msg  # what was accepted round-trips


@FUZZ
@given(generate | cancel | ping)
def test_well_shaped_frames_with_random_values(frame: dict[str, Any]) -> None:
    check(_to_json(frame))


@FUZZ
@given(generate, st.sampled_from(["id", "type", "prompt", "params"]), anything)
def test_duplicate_keys_never_crash(frame: dict[str, Any], key: str, value: Any) -> None:
    text = _to_json(frame)
    check(text[:-1] + (", " if len(frame) else "") + json.dumps(key) + ": " +
          json.dumps(value) + "}")


@FUZZ
@given(st.integers(1, 3000), st.sampled_from(["params", "messages", "prompt", "id"]))
def test_deep_nesting_inside_a_field_is_a_typed_error(depth: int, key: str) -> None:
    check('{"type": "generate", "id": "r", "' + key + '": ' + "[" * depth + "]" * depth + "}")
