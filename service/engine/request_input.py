"""What a caller hands the engine, checked exactly as the wire checks it.

`conveyor serve` decodes frames with msgspec, which enforces every range that
`protocol.messages` declares. The in-process API (`Engine.add_request`,
`Engine.generate`, `LLM`) takes Python objects instead: plain dicts, as vLLM's
`LLM.chat` and OpenAI-style clients pass them, or our Structs, which Python can
construct without any check. Both go through `msgspec.convert` against the same
Structs here, so a value the wire refuses is refused in-process too, with the
same `InvalidRequest` and the same JSON path (`$.params.temperature`), before
anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from protocol import ChatMessage, InvalidRequest, SamplingParams
from protocol.messages import TokenId

__all__ = ["coerce_messages", "coerce_params", "coerce_token_ids"]


def _invalid(e: msgspec.ValidationError, prefix: str, request_id: str | None) -> InvalidRequest:
    """msgspec's "... - at `$.temperature`" as an InvalidRequest at `prefix` + the path."""
    text = str(e)
    message, sep, where = text.rpartition(" - at `")
    param = prefix
    if sep and where.endswith("`") and where.startswith("$"):
        param = prefix + where[1:-1]
    else:
        message = text
    return InvalidRequest(f"{param}: {message}", param=param, request_id=request_id)


def coerce_params(params: SamplingParams | Mapping[str, Any] | None, *,
                  request_id: str | None = None) -> SamplingParams:
    """A validated SamplingParams from a SamplingParams, a mapping of its fields, or None.

    Raises:
        InvalidRequest: a value out of its range (NaN and infinities included), an
            unknown field, or a wrong type; `param` is e.g. "$.params.top_p".
    """
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        raw: Any = msgspec.structs.asdict(params)
    elif isinstance(params, Mapping):
        raw = dict(params)
        unknown = sorted(set(raw) - set(SamplingParams.__struct_fields__))
        if unknown:  # a typo in Python is a bug to report, not a field to ignore
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}",
                                 param=f"$.params.{unknown[0]}", request_id=request_id)
    else:
        raise InvalidRequest(f"params must be a SamplingParams or a mapping of its fields, "
                             f"got {type(params).__name__}", param="$.params",
                             request_id=request_id)
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise _invalid(e, "$.params", request_id) from None


def coerce_messages(messages: Sequence[ChatMessage | Mapping[str, Any]], *,
                    request_id: str | None = None) -> list[ChatMessage]:
    """ChatMessages from ChatMessages or `{"role": ..., "content": ...}` dicts.

    Raises:
        InvalidRequest: not a non-empty list of such turns, or a field of the wrong type
            (`param` e.g. "$.messages[1].content").
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidRequest(f"messages must be a list of {{'role', 'content'}} turns, got "
                             f"{type(messages).__name__}", param="$.messages",
                             request_id=request_id)
    raw = [msgspec.structs.asdict(m) if isinstance(m, ChatMessage) else m for m in messages]
    try:
        turns = msgspec.convert(raw, list[ChatMessage])
    except msgspec.ValidationError as e:
        raise _invalid(e, "$.messages", request_id) from None
    if not turns:
        raise InvalidRequest("messages must hold at least one turn", param="$.messages",
                             request_id=request_id)
    return turns


def coerce_token_ids(token_ids: Sequence[int], *, request_id: str | None = None) -> list[int]:
    """Token ids as plain ints in [0, 2**31 - 1] (the vocabulary check comes later).

    Raises:
        InvalidRequest: not a sequence of ints, or an id out of range.
    """
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidRequest(f"prompt_token_ids must be a list of ints, got "
                             f"{type(token_ids).__name__}", param="$.prompt_token_ids",
                             request_id=request_id)
    try:
        return msgspec.convert(list(token_ids), list[TokenId])
    except msgspec.ValidationError as e:
        raise _invalid(e, "$.prompt_token_ids", request_id) from None
