"""JSON encoding and decoding of protocol frames.

The encoder and decoders are built once at import: `encode` runs for every
streamed delta, so it must not rebuild msgspec state per call.

`decode_client_frame` is the server's single entry for untrusted bytes: any
bad frame becomes `InvalidRequest` (code "invalid_request") carrying the JSON
path of the offending field and, when the frame still parses as an object
with a usable "id", that request id. It raises nothing else.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from protocol.errors import InvalidRequest
from protocol.messages import (
    MAX_ID_LENGTH,
    ClientMessage,
    ServerMessage,
)

_encoder = msgspec.json.Encoder()
_client_decoder: msgspec.json.Decoder[ClientMessage] = msgspec.json.Decoder(ClientMessage)
_server_decoder: msgspec.json.Decoder[ServerMessage] = msgspec.json.Decoder(ServerMessage)


class _IdOnly(msgspec.Struct):
    """Just the "id" of a frame that failed to decode; every other field is skipped unparsed."""

    id: Any = None


_id_decoder = msgspec.json.Decoder(_IdOnly)

# msgspec ends a ValidationError message with " - at `$.params.top_p`";
# an error at the root carries no path.
_AT_PATH = re.compile(r" - at (?:`key` in )?`(\$[^`]*)`$")  # a dict key: "at `key` in `$...`"
_MISSING_FIELD = re.compile(r"^Object missing required field `([^`]+)`")

Frame = str | bytes | bytearray | memoryview


def encode(msg: msgspec.Struct) -> bytes:
    """One frame as compact UTF-8 JSON bytes (send it as a text frame)."""
    return _encoder.encode(msg)


def decode_client_frame(data: Frame) -> ClientMessage:
    """Decode and validate one client frame: a `Generate`, `Cancel` or `Ping`.

    Args:
        data: the frame's text, or its UTF-8 bytes.

    Raises:
        InvalidRequest: for anything else: not UTF-8, not JSON, not an object,
            nested too deeply, a missing or unknown `type`, a field of the wrong
            type or out of range, not exactly one prompt form. `param` is the
            JSON path of the offending field (e.g. "$.params.max_tokens",
            "$.messages[0].role"), None when the frame as a whole is wrong;
            `request_id` is the frame's "id" when it is a valid id.
    """
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise InvalidRequest(f"a frame is text, got {type(data).__name__}")
    try:
        return _client_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(
            str(exc), param=_error_path(str(exc)), request_id=_recover_id(data)
        ) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    except UnicodeError:
        raise InvalidRequest("frame is not valid UTF-8") from None
    except RecursionError:
        raise InvalidRequest("JSON is nested too deeply") from None


def decode_server_frame(data: Frame) -> ServerMessage:
    """Decode one server frame (client side).

    Raises:
        msgspec.DecodeError: malformed JSON or not a valid server frame
            (msgspec.ValidationError, a subclass, names the field).
        UnicodeError: the bytes are not UTF-8.
        RecursionError: the JSON is nested too deeply.
        All three are what a broken or foreign server sends, not a user error.
    """
    return _server_decoder.decode(data)


def _error_path(message: str) -> str | None:
    """The JSON path named by a msgspec ValidationError message, or None for the root.

    E.g. "Expected `int`, got `str` - at `$.params.max_tokens`" -> "$.params.max_tokens";
    "Object missing required field `role` - at `$.messages[0]`" -> "$.messages[0].role".
    """
    at = _AT_PATH.search(message)
    path = at.group(1) if at else None
    missing = _MISSING_FIELD.match(message)
    if missing:
        return f"{path or '$'}.{missing.group(1)}"
    return path


def _recover_id(data: Frame) -> str | None:
    """The frame's "id" if it parses as a JSON object with a valid id string, else None."""
    try:
        rid = _id_decoder.decode(data).id
    except (ValueError, RecursionError):
        return None
    if isinstance(rid, str) and 1 <= len(rid) <= MAX_ID_LENGTH:
        return rid
    return None


__all__ = ["decode_client_frame", "decode_server_frame", "encode"]
