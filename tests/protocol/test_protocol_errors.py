"""Each wire error code has its exception, and frames convert both ways."""

from __future__ import annotations

import pytest

from protocol import (
    ContextLengthExceeded,
    DuplicateId,
    Error,
    ErrorCode,
    InternalError,
    InvalidRequest,
    Overloaded,
    ProtocolError,
    ShuttingDown,
    TooManyRequests,
    Unauthorized,
    decode_server_frame,
    encode,
    error_from_frame,
)

CODES: dict[type[ProtocolError], tuple[ErrorCode, bool]] = {
    InvalidRequest: ("invalid_request", False),
    DuplicateId: ("duplicate_id", False),
    ContextLengthExceeded: ("context_length_exceeded", False),
    TooManyRequests: ("too_many_requests", False),
    ShuttingDown: ("shutting_down", True),
    Unauthorized: ("unauthorized", False),
    InternalError: ("internal_error", False),
}


@pytest.mark.parametrize("cls", list(CODES), ids=lambda c: c.__name__)
def test_each_code_round_trips_through_the_wire(cls: type[ProtocolError]) -> None:
    code, retryable = CODES[cls]
    exc = cls("it failed", param="$.params.top_k", request_id="r7")
    assert isinstance(exc, ProtocolError)
    assert (exc.code, exc.retryable, str(exc)) == (code, retryable, "it failed")
    frame = exc.to_frame()
    assert frame == Error(
        id="r7", code=code, param="$.params.top_k", message="it failed", retryable=retryable
    )
    received = decode_server_frame(encode(frame))
    assert isinstance(received, Error)
    back = error_from_frame(received)
    assert type(back) is cls
    assert (back.message, back.param, back.request_id) == ("it failed", "$.params.top_k", "r7")
    assert back.retryable == retryable


def test_a_frames_own_retryable_flag_survives_the_client() -> None:
    """A cluster sends a retryable internal_error for a replica that died; the client's
    InternalError says so, and the class default stays as it was."""
    frame = Error(id="r9", code="internal_error", param=None, message="replica died",
                  retryable=True)
    back = error_from_frame(decode_server_frame(encode(frame)))
    assert isinstance(back, InternalError) and back.retryable is True
    assert back.to_frame() == frame
    assert InternalError("x").retryable is False and InternalError.retryable is False
    assert error_from_frame(Error(id=None, code="shutting_down", param=None, message="m",
                                  retryable=False)).retryable is False


def test_overloaded_carries_retry_after() -> None:
    exc = Overloaded("queue full", retry_after_ms=250)
    frame = exc.to_frame()
    assert (frame.code, frame.retryable, frame.retry_after_ms, frame.id) == (
        "overloaded",
        True,
        250,
        None,
    )
    received = decode_server_frame(encode(frame))
    assert isinstance(received, Error)
    back = error_from_frame(received)
    assert isinstance(back, Overloaded) and back.retry_after_ms == 250


def test_overloaded_frame_without_retry_after_reads_as_zero() -> None:
    frame = Error(id="r1", code="overloaded", param=None, message="full", retryable=True)
    back = error_from_frame(frame)
    assert isinstance(back, Overloaded) and back.retry_after_ms == 0


def test_negative_retry_after_is_refused() -> None:
    with pytest.raises(ValueError, match="retry_after_ms"):
        Overloaded("full", retry_after_ms=-1)


def test_repr_names_code_and_param() -> None:
    text = repr(InvalidRequest("bad", param="$.id", request_id=None))
    assert "invalid_request" in text and "$.id" in text
