"""Admission: check what the caller sent, fill its defaults, tokenize it off the loop.

The one place a request's input is checked and completed, used by every engine: the
in-process `Engine`, the cluster's `RemoteEngine` (before it routes anything) and the
offline `LLM`. In order:

1. the params (`request_input.coerce_params`: the wire's own ranges; `stop_token_ids`
   and `logit_bias` keys within the vocabulary; min_tokens <= max_tokens) and the
   prompt's shape, on the event loop;
2. a lower bound on the prompt's length from its character count (cheap: a prompt that
   cannot fit is refused before it is tokenized);
3. chat templating and tokenizing (`PromptTokenizer`) in a small thread pool, never on
   the event loop (as vLLM's and SGLang's front ends do), so a huge prompt never stalls
   other clients' streams; token ids need none;
4. the sampling defaults (`SamplingDefaults`: the model's generation config) for every
   unset value, and the one default-`max_tokens` rule (`SamplingDefaults.output_limit`:
   the room the context leaves, vLLM's rule); a prompt that leaves none, with no
   max_tokens sent, is refused naming the prompt's field, never max_tokens;
5. the room check: prompt + max_tokens within the context and within the whole KV cache
   (a request that could never fit the pool alone would wait forever in the scheduler);
6. the output constraint (structured output, tool calls: `service.engine.constraints`):
   its grammar compiled in a thread pool of its own and cached, so a request reaches the
   step loop with its matcher ready (`prepare_full`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec

from protocol import ContextLengthExceeded, InvalidRequest, Overloaded, SamplingParams
from protocol.structured import Tool, ToolChoice
from service.engine.client import EngineRequest
from service.engine.constraints.compiler import GrammarCompiler
from service.engine.constraints.grammar import GrammarSource, grammar_of_params
from service.engine.constraints.tools import ToolFormat, ToolPlan
from service.engine.request_input import PromptTokenizer
from service.engine.request_input import (coerce_messages, coerce_params, coerce_token_ids,
                                          invalid_at)
from service.engine.sampling_defaults import SamplingDefaults

__all__ = ["Admission", "Prepared"]


class Prepared(NamedTuple):
    """A request ready to queue: prompt ids, checked params, its own grammar matcher (an
    llguidance LLMatcher; None when unconstrained) and how its tool calls are written
    (None without tools)."""

    ids: list[int]
    params: SamplingParams
    matcher: Any
    tool_format: ToolFormat | None


class Admission:
    """Checks and tokenizes requests for one model.

    Args:
        tokenizer: the model's transformers fast tokenizer (chat template included).
        vocab_size: token ids must be < this.
        max_model_len: context cap, tokens.
        num_kv_blocks, block_size: the whole KV cache (a request must fit it alone).
        defaults: what unset sampling values become (the model's generation config).
        eos_token_ids: the model's EOS ids (a grammar allows them where it accepts).
        max_pending: most prompts being tokenized at once (beyond: Overloaded).
        retry_after_ms: when an Overloaded caller should retry, ms.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 num_kv_blocks: int, block_size: int, defaults: SamplingDefaults | None = None,
                 *, eos_token_ids: Iterable[int] = (), max_pending: int = 1024,
                 retry_after_ms: Callable[[], int] = lambda: 1000) -> None:
        self.prompts = PromptTokenizer(tokenizer, vocab_size)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
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
        self.grammars.close()

    @property
    def room(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context, or the whole
        KV cache where that is smaller."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)

    async def prepare(self, request: EngineRequest) -> tuple[list[int], SamplingParams]:
        """(prompt token ids, checked params) of one request; the params' unset
        temperature / top_p / top_k / min_p / repetition_penalty / max_tokens take
        `self.defaults`, here and nowhere else (an unset max_tokens: what the context and
        the KV cache leave after the prompt, capped by the model's max_new_tokens). Its
        output constraint is checked for its shape but not compiled (`prepare_full` does).

        Raises InvalidRequest (the field named), ContextLengthExceeded, Overloaded (too
        many prompts being tokenized).
        """
        ids, params, _, _ = await self._prepare(request, compile_grammar=False)
        return ids, params

    async def prepare_full(self, request: EngineRequest) -> Prepared:
        """`prepare`, then the output constraint compiled (off the event loop, cached):
        the request's own matcher. Raises as `prepare`, and InvalidRequest for a grammar
        the constraint library refuses or one that admits no output."""
        return Prepared(*await self._prepare(request, compile_grammar=True))

    async def _prepare(self, request: EngineRequest, compile_grammar: bool) -> tuple[
            list[int], SamplingParams, Any, ToolFormat | None]:
        client_id = request.client_id or ""
        params, unset_max, tokenize, plan, source = self._check(request, client_id)
        if request.prompt_token_ids is not None:
            ids = tokenize()  # nothing to tokenize: a range check, at once
        else:
            if self.pending >= self.max_pending:
                raise Overloaded(f"too many prompts are being tokenized ({self.pending} at "
                                 f"once: the server's --max-waiting-requests); retry later",
                                 request_id=client_id,
                                 retry_after_ms=self.retry_after_ms())
            self.pending += 1
            try:
                ids = await asyncio.get_running_loop().run_in_executor(self._pool, tokenize)
            finally:
                self.pending -= 1
        params = self._fit(len(ids), params, unset_max, client_id, request)
        matcher = None
        if source is not None and compile_grammar:
            matcher = await self.grammars.compile(source, client_id)
        return ids, params, matcher, plan.format if plan is not None else None

    def prepare_sync(self, request: EngineRequest) -> Prepared:
        """`prepare_full` for a caller without an event loop (`service.engine.llm.LLM`):
        the same checks, in the same order, tokenizing and compiling in the calling thread.
        Same errors but Overloaded."""
        client_id = request.client_id or ""
        params, unset_max, tokenize, plan, source = self._check(request, client_id)
        ids = tokenize()
        params = self._fit(len(ids), params, unset_max, client_id, request)
        matcher = self.grammars.compile_sync(source, client_id) if source is not None else None
        return Prepared(ids, params, matcher, plan.format if plan is not None else None)

    def _check(self, request: EngineRequest, client_id: str
               ) -> tuple[SamplingParams, bool, Callable[[], list[int]], ToolPlan | None,
                          GrammarSource | None]:
        """The cheap checks (params, token ids against the vocabulary, the prompt's shape, a
        length bound from its characters, the tools and the output constraint's shape);
        returns the checked params, whether the caller left max_tokens unset (then `_fit`
        sets it for the prompt), the tokenizing call still to make, the tool plan and the
        grammar to compile (None: unconstrained)."""
        raw = coerce_params(request.params, request_id=client_id)
        self._check_vocabulary(raw, client_id)
        params = self.defaults.apply(raw, 0, self.room)  # an unset max_tokens: set in _fit
        messages, prompt, token_ids = request.messages, request.prompt, request.prompt_token_ids
        if messages is not None:
            messages = coerce_messages(messages, request_id=client_id)
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}",
                                 param="$.prompt", request_id=client_id)
        if token_ids is not None:
            token_ids = coerce_token_ids(token_ids, request_id=client_id)
        if raw.max_tokens is not None and raw.min_tokens > raw.max_tokens:
            raise InvalidRequest(f"min_tokens ({raw.min_tokens}) must be at most max_tokens "
                                 f"({raw.max_tokens})", param="$.params.min_tokens",
                                 request_id=client_id)
        plan = self._tool_plan(request, client_id)
        source = self._constraint(params, plan, client_id)
        least = self.prompts.min_tokens(messages=messages, prompt=prompt, token_ids=token_ids)
        if raw.max_tokens is None:
            if least >= self.room:
                self._no_room(f"the prompt (at least {least} tokens)", request, client_id)
        elif least + raw.max_tokens > self.max_model_len:
            shown = f"prompt (at least {least} tokens) + " if least else ""
            raise ContextLengthExceeded(
                f"{shown}max_tokens ({raw.max_tokens}) exceeds the context "
                f"({self.max_model_len})", param="$.params.max_tokens", request_id=client_id,
                prompt_alone=least >= self.max_model_len)
        if request.continue_final_message and messages is None:
            raise InvalidRequest("continue_final_message needs messages",
                                 param="$.continue_final_message", request_id=client_id)
        return params, raw.max_tokens is None, functools.partial(
            self.prompts, messages=messages, prompt=prompt, token_ids=token_ids,
            request_id=client_id, continue_final=bool(request.continue_final_message),
            tools=plan if messages is not None else None), plan, source

    def _tool_plan(self, request: EngineRequest, client_id: str) -> ToolPlan | None:
        """The request's tools and tool_choice, checked. Tools go with `messages` (or with
        `prompt_token_ids` a caller rendered with them: the cluster's replicas)."""
        if request.tools is None and request.tool_choice is None:
            return None
        raw = [msgspec.structs.asdict(t) if isinstance(t, Tool) else t
               for t in request.tools or ()]
        try:
            tools = msgspec.convert(raw, list[Tool])
        except msgspec.ValidationError as e:
            raise invalid_at(e, "$.tools", client_id) from None
        choice = request.tool_choice
        try:
            choice = msgspec.convert(msgspec.to_builtins(choice), ToolChoice | None)
        except msgspec.ValidationError as e:
            raise invalid_at(e, "$.tool_choice", client_id) from None
        if tools and request.prompt is not None:
            raise InvalidRequest("tools need `messages` (a chat), not a raw prompt",
                                 param="$.tools", request_id=client_id)
        style = request.tool_style or self.prompts.tool_style
        return ToolPlan.make(tools, choice, style, client_id,
                             parallel=request.parallel_tool_calls)

    def _constraint(self, params: SamplingParams, plan: ToolPlan | None,
                    client_id: str) -> GrammarSource | None:
        """The grammar the output must follow (tools, or params' response_format /
        structured), shape-checked; None when the output is free. A request that names no
        constraint and no tools never reaches the grammar code (as `_tool_plan` returns at
        once without tools)."""
        if plan is None and params.response_format is None and params.structured is None:
            return None
        own = grammar_of_params(params, client_id)
        if plan is not None and own is not None:
            raise InvalidRequest("a JSON response_format or `structured` cannot be combined "
                                 "with tools (tool_choice \"none\" leaves them out)",
                                 param=own.param, request_id=client_id)
        source = plan.grammar(client_id) if plan is not None else own
        if source is not None and params.ignore_eos:
            raise InvalidRequest("ignore_eos cannot be used with a constrained output (it "
                                 "ends where the grammar does)", param="$.params.ignore_eos",
                                 request_id=client_id)
        return source

    def _check_vocabulary(self, params: SamplingParams, client_id: str) -> None:
        """Raise InvalidRequest for a stop_token_ids entry or a logit_bias key outside the
        vocabulary (vLLM answers 400 for both)."""
        vocab = self.prompts.vocab_size
        for i, t in enumerate(params.stop_token_ids):
            if t >= vocab:
                raise InvalidRequest(f"stop_token_ids[{i}] ({t}) is outside the vocabulary "
                                     f"(size {vocab}: ids 0 to {vocab - 1})",
                                     param=f"$.params.stop_token_ids[{i}]", request_id=client_id)
        for t in sorted(params.logit_bias or ()):
            if t >= vocab:
                raise InvalidRequest(f"logit_bias has token id {t}, outside the vocabulary "
                                     f"(size {vocab}: ids 0 to {vocab - 1})",
                                     param="$.params.logit_bias",
                                     request_id=client_id)

    def _no_room(self, what: str, request: EngineRequest, client_id: str) -> None:
        """Raise ContextLengthExceeded for a request without max_tokens whose prompt leaves
        no room for output; it names the prompt's field (the client sent no max_tokens)."""
        field = ("$.messages" if request.messages is not None else
                 "$.prompt" if request.prompt is not None else "$.prompt_token_ids")
        raise ContextLengthExceeded(
            f"{what} leaves no room for output: a request holds at most {self.room} tokens "
            "(the context, or the whole KV cache where that is smaller)", param=field,
            request_id=client_id, prompt_alone=True)

    def _fit(self, n: int, params: SamplingParams, unset_max: bool, client_id: str,
             request: EngineRequest) -> SamplingParams:
        """params for a prompt of n tokens: an unset max_tokens becomes the default output
        limit, what the context and the KV cache leave (vLLM's rule; the generation
        config's max_new_tokens caps it); then `check_fits`."""
        if unset_max:
            if n >= self.room:
                self._no_room(f"the prompt ({n} tokens)", request, client_id)
            params = msgspec.structs.replace(
                params, max_tokens=self.defaults.output_limit(n, self.room,
                                                              request.default_max_tokens))
            if params.min_tokens > params.max_tokens:
                raise InvalidRequest(
                    f"min_tokens ({params.min_tokens}) is more than the room the context "
                    f"leaves for output ({params.max_tokens} tokens)",
                    param="$.params.min_tokens", request_id=client_id)
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
                f"({need * self.block_size} tokens) but the whole cache has {self.num_kv_blocks} "
                f"({self.num_kv_blocks * self.block_size} tokens; the server's "
                f"--kv-cache-memory sets its size)", param="$.params.max_tokens",
                request_id=client_id,
                prompt_alone=-(-(n + 1) // self.block_size) > self.num_kv_blocks)
