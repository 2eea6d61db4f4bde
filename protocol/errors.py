"""The exception tree of the wire protocol: one class per `error` code.

The server raises these where a request fails and sends `exc.to_frame()`;
the client turns a received `error` frame back into the same class with
`error_from_frame`. Codes and retryability follow PROTOCOL.md.
"""

from __future__ import annotations

from typing import ClassVar

from protocol.messages import Error, ErrorCode


class ProtocolError(Exception):
    """A request failed with a wire error code.

    Attributes:
        code: the wire code (e.g. "invalid_request").
        message: human-readable reason.
        param: JSON path of the offending field (e.g. "$.params.max_tokens") or None.
        request_id: the request's id, or None when the frame could not be tied to one.
        retryable: whether the same request may succeed later unchanged (the class's
            default unless given: a received frame's own flag wins).
    """

    code: ClassVar[ErrorCode] = "internal_error"
    retryable: bool = False

    def __init__(
        self, message: str, *, param: str | None = None, request_id: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.request_id = request_id
        if retryable is not None:
            self.retryable = retryable

    def to_frame(self) -> Error:
        """The `error` frame that reports this exception."""
        return Error(
            id=self.request_id,
            code=self.code,
            param=self.param,
            message=self.message,
            retryable=self.retryable,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, code={self.code!r}, "
            f"param={self.param!r}, request_id={self.request_id!r})"
        )


class InvalidRequest(ProtocolError):
    """Malformed JSON, unknown type, wrong field types or values out of range."""

    code: ClassVar[ErrorCode] = "invalid_request"


class DuplicateId(ProtocolError):
    """The id is already used by a request of this connection that is in flight."""

    code: ClassVar[ErrorCode] = "duplicate_id"


class ContextLengthExceeded(ProtocolError):
    """Prompt tokens + max_tokens exceed the model's context (`max_model_len`).

    Attributes:
        prompt_alone: the prompt by itself leaves no room for one output token (whatever
            max_tokens is); the fronts with fields of their own name the prompt's field
            then (OpenAI's `messages` / `prompt`, the Responses API's `input`). Not on the
            wire: a received frame gives False.
    """

    code: ClassVar[ErrorCode] = "context_length_exceeded"

    def __init__(self, message: str, *, prompt_alone: bool = False, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.prompt_alone = prompt_alone


class Overloaded(ProtocolError):
    """The admission queue is full; retry after `retry_after_ms` milliseconds."""

    code: ClassVar[ErrorCode] = "overloaded"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        retry_after_ms: int,
        param: str | None = None,
        request_id: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        if retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {retry_after_ms}")
        super().__init__(message, param=param, request_id=request_id, retryable=retryable)
        self.retry_after_ms = retry_after_ms

    def to_frame(self) -> Error:
        frame = super().to_frame()
        frame.retry_after_ms = self.retry_after_ms
        return frame


class TooManyRequests(ProtocolError):
    """This connection already has its cap of requests in flight."""

    code: ClassVar[ErrorCode] = "too_many_requests"


class ShuttingDown(ProtocolError):
    """The server is draining and takes no new requests; another instance may."""

    code: ClassVar[ErrorCode] = "shutting_down"
    retryable = True


class Unauthorized(ProtocolError):
    """Missing or wrong API key."""

    code: ClassVar[ErrorCode] = "unauthorized"


class InternalError(ProtocolError):
    """The server failed; the request is lost."""

    code: ClassVar[ErrorCode] = "internal_error"


class ClientConnectionClosed(ConnectionError):
    """The client's socket closed; every stream still open ends with this.

    Attributes:
        close_code: the WebSocket close code (e.g. 1000, 1006, 1009) or None.
        reason: the close reason or a description of what ended the connection.
    """

    def __init__(self, reason: str, *, close_code: int | None = None) -> None:
        super().__init__(f"connection closed ({close_code}): {reason}" if close_code else reason)
        self.close_code = close_code
        self.reason = reason


_BY_CODE: dict[str, type[ProtocolError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        DuplicateId,
        ContextLengthExceeded,
        TooManyRequests,
        ShuttingDown,
        Unauthorized,
        InternalError,
    )
}


def error_from_frame(frame: Error) -> ProtocolError:
    """The exception matching a received `error` frame (client side), with the frame's
    own `retryable` (e.g. a cluster's `internal_error` for a replica that died is
    retryable on another replica).

    `overloaded` gives an `Overloaded` whose `retry_after_ms` is the frame's
    (0 when the frame has none).
    """
    if frame.code == Overloaded.code:
        return Overloaded(
            frame.message,
            retry_after_ms=frame.retry_after_ms or 0,
            param=frame.param,
            request_id=frame.id,
            retryable=frame.retryable,
        )
    return _BY_CODE[frame.code](frame.message, param=frame.param, request_id=frame.id,
                                retryable=frame.retryable)


__all__ = [
    "ClientConnectionClosed",
    "ContextLengthExceeded",
    "DuplicateId",
    "InternalError",
    "InvalidRequest",
    "Overloaded",
    "ProtocolError",
    "ShuttingDown",
    "TooManyRequests",
    "Unauthorized",
    "error_from_frame",
]
