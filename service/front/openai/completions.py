"""POST /v1/completions' body -> Plan, checked field by field (pure).

Served beside the fields both routes share (`service.front.openai.request`): prompt (a
string, a list of strings, token ids, a list of token-id lists; each prompt gets n
choices), echo, best_of (= n), and `logprobs` (an integer 0..20; OpenAI's own cap is 5,
vLLM's 20), with `echo` the prompt tokens' too (lm-eval's loglikelihood requests).
"""

from __future__ import annotations

from typing import Any

from protocol.messages import MAX_LOGPROBS
from service.front.openai.errors import bad
from service.front.openai.request import (COMMON_FIELDS, MAX_N, Plan, check_fields, check_model,
                                          common_fields, structured_fields, typed_field)

_COMPLETIONS = COMMON_FIELDS | {"prompt", "echo", "best_of"}


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and
                                                   not isinstance(t, bool) for t in x)


def completion_plan(body: Any, served_model: str) -> Plan:
    """POST /v1/completions. Raises OpenAIError (400 with `param`, 404 model)."""
    body = check_fields(body, _COMPLETIONS)
    check_model(body, served_model)
    params: dict[str, Any] = {}
    n, stream, include_usage, continuous = common_fields(body, params, {})
    asked_prompt_logprobs = "prompt_logprobs" in params
    renames = {} if asked_prompt_logprobs else {"prompt_logprobs": "logprobs"}
    structured_fields(body, params, renames)
    best_of = typed_field(body, "best_of", int, "an integer")
    if best_of is not None and best_of != n:
        raise bad("best_of", "best_of is only served equal to n", "unsupported_value")
    echo = bool(typed_field(body, "echo", bool, "a boolean"))
    num = typed_field(body, "logprobs", int, "an integer")
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
