"""Per-request stream checks: only its own tokens, contiguous, counted right."""

from __future__ import annotations

import pytest

from protocol import Delta, Done, Timings, Usage
from service.bench.checks import StreamCheck
from service.bench.request_spec import RequestSpec

SPEC = RequestSpec(7, (1, 2, 3), 4)


def _done(completion: int = 4, prompt: int = 3, reason: str = "length", rid: str = "b7") -> Done:
    return Done(id=rid, finish_reason=reason,
                usage=Usage(prompt_tokens=prompt, completion_tokens=completion,
                            total_tokens=prompt + completion),
                timings=Timings())


def _feed(check: StreamCheck, *deltas: tuple[str, int, list[int]]) -> None:
    for rid, index, ids in deltas:
        check.delta(Delta(id=rid, index=index, text="x", token_ids=ids))


def test_a_right_stream_with_a_merged_delta_passes():
    check = StreamCheck(SPEC, ignore_eos=True)
    _feed(check, ("b7", 0, [5]), ("b7", 1, [6, 7]), ("b7", 3, [8]))
    assert check.done(_done()) == []


@pytest.mark.parametrize("deltas, done, expected", [
    ([("b7", 0, [5]), ("b7", 2, [6]), ("b7", 3, [7, 8])], _done(), "index 2, expected 1"),
    ([("b7", 0, [5]), ("b7", 0, [6]), ("b7", 2, [7, 8])], _done(), "index 0, expected 1"),
    ([("b9", 0, [5, 6, 7, 8])], _done(), "delta for id 'b9'"),
    ([("b7", 0, [5, 6, 7, 8])], _done(completion=5), "completion_tokens 5 != 4"),
    ([("b7", 0, [5, 6, 7, 8])], _done(prompt=9), "prompt_tokens 9 != 3"),
    ([("b7", 0, [5, 6, 7])], _done(completion=3, reason="stop"), "3 tokens received under ignore_eos"),
    ([("b7", 0, [5, 6, 7, 8])], _done(reason="error"), "finish_reason 'error'"),
    ([("b7", 0, [5, 6, 7, 8])], _done(rid="b8"), "done for id 'b8'"),
])
def test_wrong_streams_are_caught(deltas, done, expected):
    check = StreamCheck(SPEC, ignore_eos=True)
    _feed(check, *deltas)
    problems = check.done(done)
    assert any(expected in p for p in problems), problems


def test_without_ignore_eos_a_short_completion_is_fine():
    check = StreamCheck(SPEC, ignore_eos=False)
    _feed(check, ("b7", 0, [5, 2]))
    assert check.done(_done(completion=2, reason="stop")) == []


def test_request_spec():
    assert SPEC.id == "b7" and SPEC.input_len == 3
    assert RequestSpec(0, (1,), 2, prompt="hi").wire() == {"prompt": "hi"}
    assert RequestSpec(0, (1,), 2, messages=(("user", "hi"),)).wire() == {
        "messages": [{"role": "user", "content": "hi"}]}
    for bad in ({"prompt_token_ids": ()}, {"max_tokens": 0}, {"index": -1},
                {"prompt": "a", "messages": (("user", "b"),)}):
        kwargs = {"index": 0, "prompt_token_ids": (1,), "max_tokens": 1, **bad}
        with pytest.raises(ValueError):
            RequestSpec(**kwargs)
