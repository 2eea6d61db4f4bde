"""An OpenAI request body -> what to ask the engine, checked field by field (pure): the
fields both routes share, their structured output, and the chat body (`chat_plan`); the
legacy completions body is `service.front.openai.completions`.

Served (OpenAI's names; the engine checks every value's range as the wire does):
    both:  model (absent or the served name), max_tokens, temperature, top_p, seed,
           stop (a string or up to 8), n (1..MAX_N; choice i of a seeded request uses
           seed + i), user, stream, stream_options (include_usage, continuous_usage_stats:
           usage in every chunk), presence_penalty, frequency_penalty, logit_bias (token
           id strings -> [-100, 100]); the extras vLLM accepts: top_k, min_p, ignore_eos,
           priority, stop_token_ids, repetition_penalty, min_tokens, prompt_logprobs (not
           with stream, as vLLM), return_token_ids; accepted and ignored: metadata,
           store, service_tier
    chat:  messages (role system / developer (sent as system) / user / assistant / tool,
           content a string or a list of {"type": "text", "text"} parts; a tool message's
           tool_call_id is accepted, the content alone rendered),
           max_completion_tokens, tools, tool_choice, parallel_tool_calls (assistant turns
           may carry `tool_calls`, tool turns `tool_call_id`), vLLM's echo (the last
           message's content before the answer when it is the assistant's),
           continue_final_message and add_generation_prompt (not both true)
    logprobs: chat `logprobs` (a boolean) + `top_logprobs` (0..20, needs logprobs).
           Values are the model's raw distribution (`protocol.SamplingParams`).

Structured output (both routes), one source per request:
    response_format            OpenAI's {"type": "text" | "json_object" | "json_schema"}
    structured_outputs         vLLM's {"json": schema, "json_object": true, "regex": ...,
                               "choice": [...], "grammar": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names for them
    json_schema, grammar       llama.cpp's server's fields (a schema; GBNF or Lark)
They become the engine's `response_format` / `structured` params, checked there (a bad
schema or regex is a 400 naming the field the client sent).

Tools (chat only): `tools`, `tool_choice` ("none", "auto", "required", {"type": "function",
"function": {"name"}}) and `parallel_tool_calls` (true: several calls may follow each
other; absent or false: one call, llama.cpp's default), handed to the engine
(`service.engine.constraints.tools`).

Refused with 400 naming the field: functions, function_call, suffix, audio, modalities,
prediction, web_search_options, and any unknown field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import MAX_LOGPROBS
from service.front.openai.errors import OpenAIError, bad

MAX_N = 16
_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "json_schema": "json", "grammar": "grammar"}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *_ALIASES,
                     "guided_decoding_backend"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
_SO_KEYS = {"json", "json_object", "regex", "choice", "grammar"}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
                 "stream", "stream_options", "top_k", "min_p", "ignore_eos", "priority",
                 "stop_token_ids", "presence_penalty", "frequency_penalty", "logprobs",
                 "metadata", "store", "service_tier", "repetition_penalty", "logit_bias",
                 "min_tokens", "prompt_logprobs", "return_token_ids"} | STRUCTURED_FIELDS
_CHAT = COMMON_FIELDS | TOOL_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                                       "echo", "continue_final_message", "add_generation_prompt"}
_UNSUPPORTED = {"functions", "function_call", "suffix", "audio", "modalities",
                "prediction", "web_search_options", "reasoning_effort", "verbosity"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks for.

    prompts: EngineRequest prompt fields (`messages=`, `prompt=` or `prompt_token_ids=`), one
        per prompt; choices: len(prompts) x n, choice index = prompt index x n + j.
    params: SamplingParams fields (the engine checks them); renames: our param -> the
        field the client named (for error `param`s).
    echo: put each prompt before its completions (completions' echo; chat: the last
        message's content, when it is the assistant's); with `logprobs` the prompt tokens
        are scored too (params["prompt_logprobs"]).
    continuous_usage: `stream_options.continuous_usage_stats`: usage in every chunk.
    return_prompt_logprobs: vLLM's `prompt_logprobs` field was sent (its value is
        params["prompt_logprobs"]): the response carries them.
    return_token_ids: vLLM's `return_token_ids`: prompt_token_ids and token_ids in it.
    continue_final_message: the answer continues the last message (chat).
    """

    kind: str
    prompts: list[dict[str, Any]]
    params: dict[str, Any]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    renames: dict[str, str] = field(default_factory=dict)
    continuous_usage: bool = False
    return_prompt_logprobs: bool = False
    return_token_ids: bool = False
    continue_final_message: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def typed_field(body: dict, name: str, types: type | tuple[type, ...], what: str) -> Any:
    """body[name], or None when absent or null. Raises OpenAIError 400 `invalid_type`
    naming the field when it is not of `types` (a boolean is no number); `what` names
    the type in the message."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(name, f"{name} must be {what}, got a boolean", "invalid_type")
    if not isinstance(value, types):
        raise bad(name, f"{name} must be {what}, got {type(value).__name__}", "invalid_type")
    return value


def check_fields(body: Any, allowed: set[str]) -> dict:
    """`body` as a dict. Raises OpenAIError 400: not an object (`invalid_json`), a field
    this server does not serve (`unsupported_parameter`), one not in `allowed`
    (`unknown_parameter`)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    for name in body:
        if name in _UNSUPPORTED:
            raise bad(name, f"{name} is not supported by this server", "unsupported_parameter")
        if name not in allowed:
            raise bad(name, f"unknown parameter {name!r}", "unknown_parameter")
    return body


def check_model_name(model: str, served: str) -> None:
    """Raises OpenAIError 404 `model_not_found` unless `model` is the served name."""
    if model != served:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                          f"{served!r}", param="model", code="model_not_found")


def check_model(body: dict, served: str) -> None:
    """The body's `model`, absent or the served name (`check_model_name`)."""
    model = typed_field(body, "model", str, "a string")
    if model is not None:
        check_model_name(model, served)


def common_fields(body: dict, params: dict[str, Any], renames: dict[str, str]
                  ) -> tuple[int, bool, bool, bool]:
    """The fields both routes share into `params` (SamplingParams fields); returns (n,
    stream, include_usage, continuous_usage). Raises OpenAIError 400 naming the field."""
    for name in ("temperature", "top_p", "min_p"):
        v = typed_field(body, name, (int, float), "a number")
        if v is not None:
            params[name] = float(v)
    for name in ("top_k", "seed", "priority", "max_tokens"):
        v = typed_field(body, name, int, "an integer")
        if v is not None:
            params[name] = v
    if body.get("top_k") == -1:  # vLLM's "off"
        params["top_k"] = 0
    v = typed_field(body, "ignore_eos", bool, "a boolean")
    if v is not None:
        params["ignore_eos"] = v
    stop = body.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        params["stop"] = stop
    elif stop is not None:
        raise bad("stop", "stop must be a string or a list of strings", "invalid_type")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in ids):
            raise bad("stop_token_ids", "stop_token_ids must be a list of integers", "invalid_type")
        params["stop_token_ids"] = ids
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = typed_field(body, name, (int, float), "a number")
        if v is not None:
            params[name] = float(v)
    v = typed_field(body, "min_tokens", int, "an integer")
    if v is not None:
        params["min_tokens"] = v
    bias = typed_field(body, "logit_bias", dict, "an object of token ids to numbers")
    if bias is not None:
        params["logit_bias"] = _logit_bias(bias)
    v = typed_field(body, "prompt_logprobs", int, "an integer")
    if v is not None:
        if not 0 <= v <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                      f"got {v}")
        if body.get("stream"):
            raise bad("prompt_logprobs", "prompt_logprobs is not available with stream: true")
        params["prompt_logprobs"] = v
    typed_field(body, "return_token_ids", bool, "a boolean")
    typed_field(body, "user", str, "a string")
    n = typed_field(body, "n", int, "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad("n", f"n must be in [1, {MAX_N}], got {n}")
    stream = bool(typed_field(body, "stream", bool, "a boolean"))
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                            "continuous_usage_stats"}:
            raise bad("stream_options", "stream_options may only hold include_usage and "
                      "continuous_usage_stats")
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        for key in ("include_usage", "continuous_usage_stats"):
            if not isinstance(options.get(key, False), bool):
                raise bad(f"stream_options.{key}", f"{key} must be a boolean", "invalid_type")
        include_usage = bool(options.get("include_usage"))
        continuous = bool(options.get("continuous_usage_stats"))
    return n, stream, include_usage, continuous


def _logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's {"token id": bias} as {id: bias}; the engine checks ranges and the
    vocabulary. Raises OpenAIError naming logit_bias for a key that is not an id or a
    value that is not a number."""
    out: dict[int, float] = {}
    keys = [k for k in bias if not (isinstance(k, str) and k.isdigit() and k.isascii())]
    if keys:  # every bad key named at once (at most 8 shown), as vLLM does
        shown = ", ".join(repr(k[:32]) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        raise bad("logit_bias", f"logit_bias keys must be token ids (strings of digits), "
                  f"got {shown}")
    for key, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number", "invalid_type")
        out[int(key)] = float(value)
    return out


def _response_format(fmt: dict) -> dict:
    """OpenAI's response_format, with llama.cpp's `{"type": "json_object", "schema": S}`
    served as `json_schema` S (its server's extension; ignoring the schema would hand its
    users output that does not validate). Raises OpenAIError 400 naming a key that is none
    of `type`, `json_schema` (and `schema` with json_object), rather than ignoring it."""
    allowed = {"type", "json_schema"} | ({"schema"} if fmt["type"] == "json_object" else set())
    unknown = sorted(k for k in fmt if k not in allowed)
    if unknown:
        raise bad(f"response_format.{unknown[0]}",
                  f"response_format.{unknown[0]} is not supported", "unsupported_parameter")
    if fmt["type"] == "json_object" and "schema" in fmt:
        schema = fmt["schema"]
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.schema", "response_format.schema must be a JSON Schema "
                      "(an object or a boolean)", "invalid_type")
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    return fmt


def structured_fields(body: dict, params: dict[str, Any], renames: dict[str, str]) -> None:
    """Put the body's constraint into `params` (and where its errors point into
    `renames`). Raises OpenAIError 400 for a malformed or doubled constraint."""
    given: dict[str, tuple[str, Any]] = {}  # our key -> (the client's field, value)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad("response_format", "response_format must be an object with a `type`",
                      "invalid_type")
        fmt = _response_format(fmt)
        if fmt["type"] != "text":
            given["response_format"] = ("response_format", fmt)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "structured_outputs must be an object",
                      "invalid_type")
        unknown = sorted(k for k, v in so.items() if k not in _SO_KEYS and v is not None
                         and k not in ("disable_any_whitespace", "disable_additional_properties",
                                       "whitespace_pattern", "backend"))
        if unknown:
            raise bad(f"structured_outputs.{unknown[0]}",
                      f"structured_outputs.{unknown[0]} is not supported", "unsupported_parameter")
        for k in _SO_KEYS:
            if so.get(k) is not None and so.get(k) is not False:
                given[k] = (f"structured_outputs.{k}", so[k])
    for old, k in _ALIASES.items():
        if body.get(old) is not None:  # a second source keeps a key of its own
            given[k if k not in given else "alias:" + old] = (old, body[old])
    if len(given) > 1:
        names = [field for field, _ in given.values()]
        raise bad(names[1], f"only one output constraint per request: {', '.join(names)}")
    if not given:
        return
    (key, (field, value)), = given.items()
    if key == "response_format":
        params["response_format"] = value
        renames["response_format"] = "response_format"
    elif key == "json_object":
        params["response_format"] = {"type": "json_object"}
        renames["response_format"] = "=" + field
    elif key in ("json", "guided_json"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(field, f"{field} is not valid JSON: {e}") from None
        params["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "structured_outputs", "schema": value}}
        renames["response_format"] = "=" + field  # the schema is blamed as the field
    else:
        base = key if key in ("regex", "choice", "grammar") else _ALIASES[key]
        params["structured"] = {base: value}
        renames["structured"] = field.removesuffix(f".{base}") if "." in field else "=" + field


def tool_fields(body: dict) -> dict[str, Any]:
    """EngineRequest's `tools` / `tool_choice` / parallel calls from a chat body ({} when
    there are none). Raises OpenAIError 400 for a malformed field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean", "invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "tools must be a list", "invalid_type")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad("tool_choice", f"tool_choice must be none, auto, required or "
                      f"{{\"type\": \"function\", ...}}, got {choice!r}")
    elif choice is not None and not isinstance(choice, dict):
        raise bad("tool_choice", "tool_choice must be a string or an object", "invalid_type")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool_choice needs `tools`")
        return {}
    out: dict[str, Any] = {"tools": tools, "tool_choice": choice}
    if parallel is True:  # else one call (see EngineRequest.parallel_tool_calls)
        out["parallel_tool_calls"] = True
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{j}]", f"only text parts are served, got {kind!r}",
                          "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content", "content must be a string or a list of text parts",
              "invalid_type")


def chat_plan(body: Any, served_model: str) -> Plan:
    """POST /v1/chat/completions. Raises OpenAIError (400 with `param`, 404 model)."""
    body = check_fields(body, _CHAT)
    check_model(body, served_model)
    params: dict[str, Any] = {}
    renames: dict[str, str] = {}
    n, stream, include_usage, continuous = common_fields(body, params, renames)
    echo = bool(typed_field(body, "echo", bool, "a boolean"))
    cont = bool(typed_field(body, "continue_final_message", bool, "a boolean"))
    gen = typed_field(body, "add_generation_prompt", bool, "a boolean")
    if cont and gen:
        raise bad("continue_final_message", "continue_final_message and "
                  "add_generation_prompt cannot both be true")
    if gen is False and not cont:
        raise bad("add_generation_prompt", "add_generation_prompt: false is served only "
                  "with continue_final_message: true", "unsupported_value")
    mct = typed_field(body, "max_completion_tokens", int, "an integer")
    if mct is not None:
        params["max_tokens"] = mct
        renames["max_tokens"] = "max_completion_tokens"
    want = typed_field(body, "logprobs", bool, "a boolean")
    top = typed_field(body, "top_logprobs", int, "an integer")
    if top is not None:
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
        if not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if want:
        params["logprobs"] = top or 0
        renames["logprobs"] = "top_logprobs"
    structured_fields(body, params, renames)
    tools = tool_fields(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list", "invalid_type"
                  if messages is not None else "missing_required_parameter")
    turns = [_turn(m, f"messages[{i}]") for i, m in enumerate(messages)]
    return Plan("chat", [{"messages": turns, **tools}], params, n, stream, include_usage, echo,
                renames=renames, continuous_usage=continuous,
                return_prompt_logprobs="prompt_logprobs" in params,
                return_token_ids=bool(body.get("return_token_ids")),
                continue_final_message=cont)


def _turn(m: Any, where: str) -> dict[str, Any]:
    """One chat message as the engine's turn: role, content (text parts joined), and an
    assistant's `tool_calls` / a tool result's `tool_call_id` and `name`."""
    if not isinstance(m, dict):
        raise bad(where, "each message must be an object", "invalid_type")
    role = m.get("role")
    allowed = {"role", "content", "name"}
    if role == "assistant":
        allowed |= {"tool_calls", "refusal"}
    if role == "tool":
        allowed.add("tool_call_id")
    extra = set(m) - allowed
    if extra:
        key = sorted(extra)[0]
        raise bad(f"{where}.{key}", f"{key} is not supported in messages",
                  "unsupported_parameter")
    if role not in _ROLES:
        raise bad(f"{where}.role", f"unknown role {role!r}")
    turn: dict[str, Any] = {"role": _ROLES[role]}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", "tool_calls must be a list", "invalid_type")
        turn["tool_calls"] = calls
    content = m.get("content")
    turn["content"] = "" if content is None and (calls or role == "assistant") \
        else _content(content, where)
    if role == "tool":
        if not isinstance(m.get("tool_call_id", ""), str):
            raise bad(f"{where}.tool_call_id", "tool_call_id must be a string", "invalid_type")
        if m.get("tool_call_id") is not None:
            turn["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            turn["name"] = m["name"]
    return turn
