"""ResponsesError: one refusal of the Responses API, as an `error` event or an HTTP body.

Raised by the create parser (protocol/responses_request.py, protocol/responses_tools.py)
and by the routes; the WebSocket mode sends `event()` (the socket stays open), the HTTP
route answers `status` with OpenAI's error body.
"""

from __future__ import annotations

from protocol.responses import ErrorDetail, ErrorEvent

__all__ = ["ResponsesError"]


class ResponsesError(Exception):
    """An `error` event to send: HTTP-like `status`, OpenAI's error `type` and `code`,
    `param` (the offending field, e.g. "input[0].content[1].type") or None; `stream_id`:
    the lane of the frame it refuses, where the frame named one (None otherwise)."""

    def __init__(self, message: str, *, code: str | None, param: str | None = None,
                 status: int = 400, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.status, self.type = status, type
        self.stream_id: str | None = None

    def event(self, sequence_number: int = 0, stream_id: str | None = None) -> ErrorEvent:
        return ErrorEvent(sequence_number=sequence_number, stream_id=stream_id,
                          status=self.status,
                          error=ErrorDetail(type=self.type, code=self.code,
                                            message=self.message, param=self.param))
