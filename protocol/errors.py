"""The exception tree of the wire protocol: one class per `error` code.

The server raises these where a request fails and sends `exc.to_frame()`;
the client turns a received `error` frame back into the same class with
`error_from_frame`. Codes and retryability follow PROTOCOL.md.

Each class also carries the one status table every front reads (`http_status`,
`close_code`; `status_of(code)` for a received frame's code):

| code                    | HTTP | WebSocket close (where a socket is refused for it) |
|-------------------------|------|----------------------------------------------------|
| invalid_request         | 400  | 1008 policy violation                              |
| duplicate_id            | 400  | 1008                                               |
| context_length_exceeded | 400  | 1008                                               |
| unauthorized            | 401  | 1008                                               |
| overloaded              | 429  | 1013 try again later                               |
| too_many_requests       | 429  | 1013                                               |
| internal_error          | 500  | 1011 internal error                                |
| shutting_down           | 503  | 1013                                               |

429 for `overloaded` is OpenAI's `rate_limit_error` (with Retry-After), which the OpenAI
SDKs retry with back-off; 503 is kept for a server that takes no new requests at all.
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
    http_status: ClassVar[int] = 500
    close_code: ClassVar[int] = 1011
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
    http_status: ClassVar[int] = 400
    close_code: ClassVar[int] = 1008


class DuplicateId(ProtocolError):
    """The id is already used by a request of this connection that is in flight."""

    code: ClassVar[ErrorCode] = "duplicate_id"
    http_status: ClassVar[int] = 400
    close_code: ClassVar[int] = 1008


class ContextLengthExceeded(ProtocolError):
    """Prompt tokens + max_tokens exceed the model's context (`max_model_len`).

    Attributes:
        prompt_alone: the prompt by itself leaves no room for one output token (whatever
            max_tokens is); the fronts with fields of their own name the prompt's field
            then (OpenAI's `messages` / `prompt`, the Responses API's `input`). Not on the
            wire: a received frame gives False.
    """

    code: ClassVar[ErrorCode] = "context_length_exceeded"
    http_status: ClassVar[int] = 400
    close_code: ClassVar[int] = 1008

    def __init__(self, message: str, *, prompt_alone: bool = False, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.prompt_alone = prompt_alone


class Overloaded(ProtocolError):
    """The admission queue is full; retry after `retry_after_ms` milliseconds."""

    code: ClassVar[ErrorCode] = "overloaded"
    http_status: ClassVar[int] = 429
    close_code: ClassVar[int] = 1013
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
    http_status: ClassVar[int] = 429
    close_code: ClassVar[int] = 1013


class ShuttingDown(ProtocolError):
    """The server is draining and takes no new requests; another instance may."""

    code: ClassVar[ErrorCode] = "shutting_down"
    http_status: ClassVar[int] = 503
    close_code: ClassVar[int] = 1013
    retryable = True


class Unauthorized(ProtocolError):
    """Missing or wrong API key."""

    code: ClassVar[ErrorCode] = "unauthorized"
    http_status: ClassVar[int] = 401
    close_code: ClassVar[int] = 1008


class InternalError(ProtocolError):
    """The server failed; the request is lost."""

    code: ClassVar[ErrorCode] = "internal_error"
    http_status: ClassVar[int] = 500
    close_code: ClassVar[int] = 1011


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
        Overloaded,
        InvalidRequest,
        DuplicateId,
        ContextLengthExceeded,
        TooManyRequests,
        ShuttingDown,
        Unauthorized,
        InternalError,
    )
}


def error_class(code: str) -> type[ProtocolError]:
    """The class of wire error `code`; InternalError for a code this version does not know."""
    return _BY_CODE.get(code, InternalError)


def status_of(code: str) -> int:
    """The HTTP status of wire error `code` (the table in the module docstring)."""
    return error_class(code).http_status


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
    "error_class",
    "error_from_frame",
    "status_of",
]
