"""Admission's per-request work: check what the caller sent, and tokenize it off the loop.

The Admission actor of DESIGN.md is `Engine.add_request` plus the bounded queue it
fills; this is what it does before queueing: the params, the prompt's shape and a
lower bound on its length from its character count first, on the event loop (cheap:
a prompt that cannot fit is refused before it is tokenized), then chat templating and
tokenizing in a small thread pool, never on the event loop (as vLLM's and SGLang's
front ends do), so a huge prompt never stalls other clients' streams.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from protocol import (ChatMessage, ContextLengthExceeded, InvalidRequest, Overloaded,
                      SamplingParams)
from service.generation_config import SamplingDefaults
from service.request_input import coerce_messages, coerce_params, coerce_token_ids
from service.tokenize_prompt import PromptTokenizer

__all__ = ["Preprocessor"]


class Preprocessor:
    """Checks and tokenizes requests for one model.

    Args:
        prompts: the model's PromptTokenizer.
        max_model_len: context cap, tokens.
        num_kv_blocks, block_size: the whole KV cache (a request must fit it alone).
        max_pending: most prompts being tokenized at once (beyond: Overloaded).
        retry_after_ms: when an Overloaded caller should retry, ms.
        defaults: what unset sampling values become (the model's generation config).
    """

    def __init__(self, prompts: PromptTokenizer, max_model_len: int, num_kv_blocks: int,
                 block_size: int, max_pending: int, retry_after_ms: Callable[[], int],
                 defaults: SamplingDefaults | None = None) -> None:
        self.prompts = prompts
        self.defaults = defaults or SamplingDefaults()
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_pending = max_pending
        self.retry_after_ms = retry_after_ms
        self.pending = 0
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="conveyor-prompt")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None,
                      prompt: str | None, prompt_token_ids: Sequence[int] | None,
                      params: SamplingParams | Mapping[str, Any] | None,
                      client_id: str) -> tuple[list[int], SamplingParams]:
        """(prompt token ids, checked params) of one request; the params' unset
        temperature / top_p / top_k / min_p / max_tokens take `self.defaults`, here and
        nowhere else (an unset max_tokens: the model's max_new_tokens capped by what the
        context and the KV cache leave after the prompt, else 256).

        Raises InvalidRequest (the field named), ContextLengthExceeded, Overloaded (too
        many prompts being tokenized).
        """
        params, unset_max, tokenize = self._check(messages, prompt, prompt_token_ids,
                                                  params, client_id)
        if prompt_token_ids is not None:
            ids = tokenize()  # nothing to tokenize: a range check, at once
        else:
            if self.pending >= self.max_pending:
                raise Overloaded("too many prompts are being tokenized", request_id=client_id,
                                 retry_after_ms=self.retry_after_ms())
            self.pending += 1
            try:
                ids = await asyncio.get_running_loop().run_in_executor(self._pool, tokenize)
            finally:
                self.pending -= 1
        params = self._fit(len(ids), params, unset_max, client_id)
        return ids, params

    def prepare_sync(self, *, messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
                     prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                     params: SamplingParams | Mapping[str, Any] | None = None,
                     client_id: str = "") -> tuple[list[int], SamplingParams]:
        """`prepare` for a caller without an event loop (`service.llm.LLM`): the same
        checks, in the same order, tokenizing in the calling thread. Same errors but
        Overloaded."""
        params, unset_max, tokenize = self._check(messages, prompt, prompt_token_ids,
                                                  params, client_id)
        ids = tokenize()
        return ids, self._fit(len(ids), params, unset_max, client_id)

    @property
    def _room(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context, or the whole
        KV cache where that is smaller."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)

    def _check(self, messages: Sequence[ChatMessage | Mapping[str, Any]] | None,
               prompt: str | None, prompt_token_ids: Sequence[int] | None,
               params: SamplingParams | Mapping[str, Any] | None,
               client_id: str) -> tuple[SamplingParams, bool, Callable[[], list[int]]]:
        """The cheap checks (params, the prompt's shape, a length bound from its
        characters); returns the checked params, whether the caller left max_tokens unset
        (then `_fit` re-fits it to the prompt) and the tokenizing call still to make."""
        raw = coerce_params(params, request_id=client_id)
        params = self.defaults.apply(raw, 1, self._room)  # max_tokens: re-fit in _fit
        if messages is not None:
            messages = coerce_messages(messages, request_id=client_id)
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}",
                                 param="$.prompt", request_id=client_id)
        if prompt_token_ids is not None:
            prompt_token_ids = coerce_token_ids(prompt_token_ids, request_id=client_id)
        prompts = self.prompts
        prompts.check_fits(prompts.min_tokens(messages=messages, prompt=prompt,
                                              token_ids=prompt_token_ids),
                           params.max_tokens, self.max_model_len, client_id)
        return params, raw.max_tokens is None, functools.partial(
            prompts, messages=messages, prompt=prompt, token_ids=prompt_token_ids,
            request_id=client_id)

    def _fit(self, n: int, params: SamplingParams, unset_max: bool,
             client_id: str) -> SamplingParams:
        """params for a prompt of n tokens: an unset max_tokens becomes the default output
        limit for what the context and the KV cache leave; then `check_fits`."""
        if unset_max:
            params = msgspec.structs.replace(
                params, max_tokens=self.defaults.output_limit(n, self._room))
        self.check_fits(n, params, client_id)
        return params

    def check_fits(self, n: int, params: SamplingParams, client_id: str) -> None:
        """Raise ContextLengthExceeded unless n prompt tokens + max_tokens fit the context
        and the whole KV cache."""
        limit = self.max_model_len
        if n + params.max_tokens > limit:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"({limit})", param="$.params.max_tokens", request_id=client_id,
                prompt_alone=n >= limit)
        need = -(-(n + params.max_tokens) // self.block_size)
        if need > self.num_kv_blocks:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
                f"but the whole cache has {self.num_kv_blocks}", param="$.params.max_tokens",
                request_id=client_id,
                prompt_alone=-(-(n + 1) // self.block_size) > self.num_kv_blocks)
