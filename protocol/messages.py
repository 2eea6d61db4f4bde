"""Every frame of the Conveyor wire protocol, version 1, as msgspec Structs.

The protocol is specified in PROTOCOL.md. Each frame is one JSON object whose
`type` field selects the Struct (a msgspec tagged union, `tag_field="type"`).
Value ranges are declared with `msgspec.Meta`, so decoding a frame validates
it and names the offending field by its JSON path (e.g. `$.params.top_p`).
Constructing a Struct directly in Python does not check those ranges; check
values from outside by decoding (`protocol.codec.decode_client_frame`) or
with `msgspec.convert(values, SamplingParams)`.

Unknown fields are ignored on decode (the usual JSON API convention), so a
newer peer may add fields without breaking an older one.

`Generate`, `Ping`, `Pong`, `Delta` and `Error` use `omit_defaults` (absent prompt
forms, default params, a missing `t`, a delta's logprobs when none were asked for,
`retry_after_ms` outside `overloaded`).
Every field PROTOCOL.md's examples show is always encoded: those fields have
no default (`Error.id`, `Error.param`, `Error.retryable`) or live in Structs
without `omit_defaults` (`SamplingParams`, `Usage.cached_tokens`, `Timings`).
A field a later issue added is left out when it does not apply (`Usage.disk_cached_tokens`
is `msgspec.UNSET` without a disk tier).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from msgspec import UNSET, Meta, Struct, UnsetType

from protocol.structured import ResponseFormat, Structured, Tool, ToolCall, ToolCallDelta, ToolChoice

PROTOCOL_VERSION = 1
"""The `protocol` number this package speaks (sent in `hello`)."""

MAX_ID_LENGTH = 128
MAX_STOP_STRINGS = 8
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
"""Most alternatives per token that `logprobs` / `prompt_logprobs` may ask for (vLLM's
default `max_logprobs`)."""

# Integer and float ranges (issue 14): every number that reaches the engine's
# arithmetic (policies, sampler, generators) is bounded here, at the boundary.
INT32_MAX = 2**31 - 1
DEFAULT_MAX_TOKENS = 256
"""max_tokens of a request that sets none, when the model's generation config has no
max_new_tokens (PROTOCOL.md's params table)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most `logit_bias` entries one request may carry (OpenAI's limit)."""
MAX_TTFT_SLO_MS = 1e9
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
"""A token id as the wire carries it: 0 to 2**31 - 1 (the server checks it against the
vocabulary)."""

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH)]
"""A client-chosen request id: 1 to 128 characters (code points)."""

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]

ErrorCode = Literal[
    "invalid_request",
    "duplicate_id",
    "context_length_exceeded",
    "overloaded",
    "too_many_requests",
    "shutting_down",
    "unauthorized",
    "internal_error",
]


class SamplingParams(Struct, frozen=True, kw_only=True):
    """How to sample one request's completion (the `params` object of `generate`).

    The same frozen value travels from the wire into the engine. Defaults and
    ranges are those of PROTOCOL.md's params table; a JSON decode enforces the
    ranges (`Meta`), direct construction does not.

    Every number is range-checked (NaN and infinities never pass), so nothing a
    client sends can overflow the engine's policy or sampler arithmetic.

    `temperature`, `top_p`, `top_k` and `min_p` default to None, "unset": the engine
    fills an unset one from the model's generation config at admission (vLLM's
    `--generation-config auto`; see `service.engine.sampling_defaults`), so "unset" and "set
    to 1.0" differ on the wire. The values in brackets below are the neutral ones
    (`--generation-config vllm`).

    Fields:
        max_tokens: int in [1, 2**31 - 1] or None, most tokens to generate; None
            (unset): the model's generation config `max_new_tokens` (capped by what the
            context leaves after the prompt), else 256 (``DEFAULT_MAX_TOKENS``).
        temperature: float in [0, 100] or None, 0 means greedy (neutral 1.0).
        top_p: float in (0, 1] or None, nucleus sampling (neutral 1.0 = off).
        top_k: int in [0, 2**31 - 1] or None, 0 means off (neutral 0).
        min_p: float in [0, 1] or None, 0 means off (neutral 0.0).
        seed: int in [-2**63, 2**63 - 1] (64-bit) or None; the same seed, prompt and
            params give the same output.
        stop: at most 8 non-empty strings; generation ends before the first one.
        stop_token_ids: at most 256 token ids in [0, 2**31 - 1] that end generation
            besides EOS. Like EOS, the stop token itself is not part of the completion:
            its text is not sent, its id is not in `token_ids`, and it does not count
            in `usage.completion_tokens` (vLLM's default for the text).
        ignore_eos: keep generating past EOS until `max_tokens`.
        priority: int in [-2**63, 2**63 - 1] (64-bit); lower is served first (the
            vLLM convention).
        ttft_slo_ms: float in (0, 1e9] or None, target time to first token in ms.
        logprobs: int in [0, 20] or None: each generated token's log-probability and
            those of the `logprobs` most likely tokens at its position (0: the token's
            own only), in `Delta.logprobs`. None: none (the default).
        prompt_logprobs: int in [0, 20] or None: the same for every prompt token, in the
            first `Delta.prompt_logprobs` (the first prompt token has none). A request
            that asks is never served from the prefix cache (vLLM does the same), so
            every prompt position is computed.
        presence_penalty: float in [-2, 2] (0 = off): subtracted once from the logit of
            every token already in the completion (OpenAI's, vLLM's).
        frequency_penalty: float in [-2, 2] (0 = off): subtracted from a token's logit
            once per time it occurs in the completion.
        repetition_penalty: float in (0, 2] or None: the logit of every token in the
            prompt or the completion is divided by it where positive, multiplied where
            not (Keskar et al., CTRL, 2019; transformers' and vLLM's rule); None (unset):
            the model's generation config, else 1.0 (off).
        logit_bias: {token id: float in [-100, 100]} with at most 300 entries, or None:
            added to those tokens' logits before the penalties and the sampling cuts
            (the server refuses an id outside the vocabulary).
        min_tokens: int in [0, 2**31 - 1] (0 = off): EOS and `stop_token_ids` cannot be
            sampled, and stop strings are not looked for, before the completion has this
            many tokens (vLLM's); at most max_tokens.

        response_format: None or `protocol.structured.ResponseFormat`: `json_object` or
            `json_schema` constrains sampling token by token, so the completion parses
            (and validates against the schema); `text` is no constraint.
        structured: None or `protocol.structured.Structured`: a regex, a choice or a
            grammar the completion must match; never together with a JSON
            `response_format`.

    Both logprobs come from the model's own distribution, log_softmax of the raw logits, before
    temperature and the top-k / top-p / min-p cuts (vLLM's default, "raw_logprobs";
    `service.worker.sampler.compute_logprobs`). They are served on the OpenAI HTTP
    routes and in-process; the WebSocket protocol (PROTOCOL.md) has no such fields and
    refuses them.
    """

    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Annotated[
        tuple[Annotated[str, Meta(min_length=1)], ...], Meta(max_length=MAX_STOP_STRINGS)
    ] = ()
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False
    priority: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] = 0
    ttft_slo_ms: Annotated[float, Meta(gt=0.0, le=MAX_TTFT_SLO_MS)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    # structured output (issue 48): constraints on what may be sampled
    response_format: ResponseFormat | None = None
    structured: Structured | None = None

    def __post_init__(self) -> None:
        if self.structured is not None and self.response_format is not None and \
                self.response_format.type != "text":
            raise ValueError("structured and a JSON response_format cannot be used together")


class TokenLogprob(Struct, frozen=True, array_like=True, gc=False):
    """One token's log-probability (natural log) and its position's most likely tokens.

    logprob: of the token itself (sampled, or the prompt's next token); -inf when the
        model gives it probability 0.
    top: (token id, log-probability) of the K most likely tokens, most likely first
        (K = the request's `logprobs` / `prompt_logprobs`; empty for 0).
    """

    logprob: float
    top: list[tuple[int, float]]


class ChatMessage(Struct, frozen=True, omit_defaults=True):
    """One chat turn: `role` ("system", "user", "assistant", "tool", ...) and its `content`.

    An assistant turn may carry the `tool_calls` it made (its content then may be None or
    empty), a `tool` turn the `tool_call_id` it answers (and the function's `name`). The
    engine reads None content as "".
    """

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _Frame(Struct, tag_field="type", kw_only=True):
    """Base of every frame: the Struct's `tag` is its `type` on the wire."""


# --- client to server -------------------------------------------------------


class Generate(_Frame, tag="generate", omit_defaults=True):
    """Start a request. Exactly one of `messages`, `prompt`, `prompt_token_ids`.

    `messages` has at least one turn; `prompt_token_ids` are ids >= 0 (the
    server checks them against the vocabulary and rejects an empty prompt).
    Raises ValueError (msgspec.ValidationError when decoding) unless exactly
    one prompt form is given.
    """

    id: RequestId
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    params: SamplingParams = SamplingParams()
    # tool calling (issue 48): with `messages` only; tool_choice None is "auto" with tools
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None

    def __post_init__(self) -> None:
        given = (self.messages is not None) + (self.prompt is not None) + (
            self.prompt_token_ids is not None
        )
        if given != 1:
            raise ValueError(
                f"exactly one of `messages`, `prompt`, `prompt_token_ids` must be given, got {given}"
            )


class Cancel(_Frame, tag="cancel"):
    """End request `id` at the next step; unknown or finished ids are ignored."""

    id: RequestId


class Ping(_Frame, tag="ping", omit_defaults=True):
    """Application-level ping (browsers cannot send WebSocket pings); `t` is echoed."""

    t: float | None = None


ClientMessage = Union[Generate, Cancel, Ping]


# --- server to client -------------------------------------------------------


class Hello(_Frame, tag="hello", omit_defaults=True):
    """First frame on every connection.

    `sampling_defaults`: the values an unset `temperature`, `top_p`, `top_k`, `min_p`
    takes on this server (from the model's generation config); None from servers that
    predate it.
    """

    protocol: int
    model: str
    max_model_len: int
    sampling_defaults: dict[str, float] | None = None


class Pong(_Frame, tag="pong", omit_defaults=True):
    """Answer to `ping`, with its `t`."""

    t: float | None = None


class Accepted(_Frame, tag="accepted"):
    """Request `id` passed validation and was queued; its prompt is `prompt_tokens` long."""

    id: str
    prompt_tokens: int


class Delta(_Frame, tag="delta", gc=False, omit_defaults=True):
    """New completion text of request `id`.

    `index` is the completion position of `token_ids[0]`; `text` is whole
    UTF-8 characters. Consecutive deltas may arrive merged into one.

    Only for requests whose params ask (never on the WebSocket protocol, so its deltas
    encode as PROTOCOL.md shows them): `logprobs`, one `TokenLogprob` per id in
    `token_ids`; `prompt_logprobs`, on the request's first delta only, one per prompt
    token, None for the first (nothing predicts it), with the prompt's `prompt_token_ids`
    (the engine's tokenization). A first delta may then carry no token at all (the first
    token sampled was EOS).
    """

    id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    tool_calls: list[ToolCallDelta] | None = None


class Usage(Struct, kw_only=True, gc=False):
    """Token counts of a finished request; `cached_tokens` came from the prefix cache.

    `disk_cached_tokens`: of those, the ones read back from the disk KV tier. Sent only
    by a server with the tier (`--kv-disk-path`), 0 included; absent (`msgspec.UNSET`)
    otherwise, so a server without it sends PROTOCOL.md's `done` exactly. It is an
    addition to PROTOCOL.md (issue 25, item 7); older clients ignore it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0
    disk_cached_tokens: int | UnsetType = UNSET

    def __repr__(self) -> str:  # without the absent disk_cached_tokens (never "UNSET")
        fields = ["prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"]
        if self.disk_cached_tokens is not UNSET:
            fields.append("disk_cached_tokens")
        return f"Usage({', '.join(f'{f}={getattr(self, f)!r}' for f in fields)})"


class Timings(Struct, kw_only=True, gc=False):
    """Server-side timings of a finished request, in milliseconds.

    `queue_ms`: receipt to first scheduled step; `ttft_ms`: receipt to first
    token; `tpot_ms`: mean time per output token after the first; `e2e_ms`:
    receipt to end. A timing that never happened (e.g. no token before a
    cancel) is None, sent as null. `preemptions` counts swaps and recomputes.
    """

    queue_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    preemptions: int = 0


class Done(_Frame, tag="done"):
    """The one last frame of every accepted request."""

    id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tool_calls: list[ToolCall] | UnsetType = UNSET


class Error(_Frame, tag="error", omit_defaults=True):
    """A failed request (or a frame that could not be tied to one: `id` None).

    `param` is the JSON path of the offending field, or None. `retry_after_ms`
    comes with `overloaded`. After `accepted`, an error is followed by a
    `done` with finish_reason "error"; before it, the error is the only answer.
    """

    id: str | None
    code: ErrorCode
    param: str | None
    message: str
    retryable: bool
    retry_after_ms: Annotated[int, Meta(ge=0)] | None = None


ServerMessage = Union[Hello, Pong, Accepted, Delta, Done, Error]

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_ID_LENGTH",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "PROTOCOL_VERSION",
    "Accepted",
    "Cancel",
    "ChatMessage",
    "ClientMessage",
    "Delta",
    "Done",
    "Error",
    "ErrorCode",
    "FinishReason",
    "Generate",
    "Hello",
    "Ping",
    "Pong",
    "RequestId",
    "SamplingParams",
    "ServerMessage",
    "Timings",
    "TokenLogprob",
    "Usage",
]

