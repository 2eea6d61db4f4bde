"""An OpenAI request body -> what to ask the engine, checked field by field (pure).

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
           may carry `tool_calls`, tool turns `tool_call_id`; `service.front.openai.structured`);
           vLLM's echo (the last message's content before the answer when it is the
           assistant's), continue_final_message and add_generation_prompt (not both true)
    structured output (both): response_format, vLLM's structured_outputs and guided_*
    completions: prompt (a string, a list of strings, token ids, a list of token-id
           lists; each prompt gets n choices), echo, best_of (= n)
    logprobs: chat `logprobs` (a boolean) + `top_logprobs` (0..20, needs logprobs);
           completions `logprobs` (an integer 0..20; OpenAI's own cap is 5, vLLM's 20),
           with `echo` the prompt tokens' too (lm-eval's loglikelihood requests). Values
           are the model's raw distribution (`protocol.SamplingParams`).
Refused with 400 naming the field: functions, function_call, suffix, audio, modalities,
prediction, web_search_options, and any unknown field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.messages import MAX_LOGPROBS
from service.front.openai.errors import OpenAIError, bad
from service.front.openai.structured import STRUCTURED_FIELDS, TOOL_FIELDS, structured_fields, tool_fields

MAX_N = 16
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user", "stream",
           "stream_options", "top_k", "min_p", "ignore_eos", "priority", "stop_token_ids",
           "presence_penalty", "frequency_penalty", "logprobs", "metadata", "store",
           "service_tier", "repetition_penalty", "logit_bias", "min_tokens",
           "prompt_logprobs", "return_token_ids"} | STRUCTURED_FIELDS
_CHAT = _COMMON | TOOL_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "echo",
                                 "continue_final_message", "add_generation_prompt"}
_COMPLETIONS = _COMMON | {"prompt", "echo", "best_of"}
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


def _type(body: dict, name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(name, f"{name} must be {what}, got a boolean", "invalid_type")
    if not isinstance(value, types):
        raise bad(name, f"{name} must be {what}, got {type(value).__name__}", "invalid_type")
    return value


def _check_fields(body: Any, allowed: set[str]) -> dict:
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


def _check_model(body: dict, served: str) -> None:
    model = _type(body, "model", str, "a string")
    if model is not None:
        check_model_name(model, served)


def _common(body: dict, params: dict[str, Any], renames: dict[str, str]
            ) -> tuple[int, bool, bool, bool]:
    for name in ("temperature", "top_p", "min_p"):
        v = _type(body, name, (int, float), "a number")
        if v is not None:
            params[name] = float(v)
    for name in ("top_k", "seed", "priority", "max_tokens"):
        v = _type(body, name, int, "an integer")
        if v is not None:
            params[name] = v
    if body.get("top_k") == -1:  # vLLM's "off"
        params["top_k"] = 0
    v = _type(body, "ignore_eos", bool, "a boolean")
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
        v = _type(body, name, (int, float), "a number")
        if v is not None:
            params[name] = float(v)
    v = _type(body, "min_tokens", int, "an integer")
    if v is not None:
        params["min_tokens"] = v
    bias = _type(body, "logit_bias", dict, "an object of token ids to numbers")
    if bias is not None:
        params["logit_bias"] = _logit_bias(bias)
    v = _type(body, "prompt_logprobs", int, "an integer")
    if v is not None:
        if not 0 <= v <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                      f"got {v}")
        if body.get("stream"):
            raise bad("prompt_logprobs", "prompt_logprobs is not available with stream: true")
        params["prompt_logprobs"] = v
    _type(body, "return_token_ids", bool, "a boolean")
    _type(body, "user", str, "a string")
    n = _type(body, "n", int, "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad("n", f"n must be in [1, {MAX_N}], got {n}")
    stream = bool(_type(body, "stream", bool, "a boolean"))
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
    body = _check_fields(body, _CHAT)
    _check_model(body, served_model)
    params: dict[str, Any] = {}
    renames: dict[str, str] = {}
    n, stream, include_usage, continuous = _common(body, params, renames)
    echo = bool(_type(body, "echo", bool, "a boolean"))
    cont = bool(_type(body, "continue_final_message", bool, "a boolean"))
    gen = _type(body, "add_generation_prompt", bool, "a boolean")
    if cont and gen:
        raise bad("continue_final_message", "continue_final_message and "
                  "add_generation_prompt cannot both be true")
    if gen is False and not cont:
        raise bad("add_generation_prompt", "add_generation_prompt: false is served only "
                  "with continue_final_message: true", "unsupported_value")
    mct = _type(body, "max_completion_tokens", int, "an integer")
    if mct is not None:
        params["max_tokens"] = mct
        renames["max_tokens"] = "max_completion_tokens"
    want = _type(body, "logprobs", bool, "a boolean")
    top = _type(body, "top_logprobs", int, "an integer")
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


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and
                                                   not isinstance(t, bool) for t in x)


def completion_plan(body: Any, served_model: str) -> Plan:
    """POST /v1/completions. Raises OpenAIError (400 with `param`, 404 model)."""
    body = _check_fields(body, _COMPLETIONS)
    _check_model(body, served_model)
    params: dict[str, Any] = {}
    n, stream, include_usage, continuous = _common(body, params, {})
    asked_prompt_logprobs = "prompt_logprobs" in params
    renames = {} if asked_prompt_logprobs else {"prompt_logprobs": "logprobs"}
    structured_fields(body, params, renames)
    best_of = _type(body, "best_of", int, "an integer")
    if best_of is not None and best_of != n:
        raise bad("best_of", "best_of is only served equal to n", "unsupported_value")
    echo = bool(_type(body, "echo", bool, "a boolean"))
    num = _type(body, "logprobs", int, "an integer")
    if num is not None:
        if not 0 <= num <= MAX_LOGPROBS:
            raise bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {num}")
        params["logprobs"] = num
        if echo:
            params["prompt_logprobs"] = max(num, params.get("prompt_logprobs", 0))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [{"prompt": prompt}]
    elif _is_ids(prompt):
        prompts = [{"prompt_token_ids": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [{"prompt": p} for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = [{"prompt_token_ids": p} for p in prompt]
    else:
        raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids "
                  "or a list of token-id lists", "invalid_type" if prompt is not None
                  else "missing_required_parameter")
    if len(prompts) * n > 4 * MAX_N:
        raise bad("prompt", f"at most {4 * MAX_N} choices (prompts x n) per request")
    return Plan("completion", prompts, params, n, stream, include_usage, echo,
                renames=renames, continuous_usage=continuous,
                return_prompt_logprobs=asked_prompt_logprobs,
                return_token_ids=bool(body.get("return_token_ids")))
