"""One OpenAI HTTP request in flight: its choices as engine requests, their events, and
the response built from them (one JSON body, or SSE chunks).

Each choice is one engine request (`add_request(EngineRequest(...), sink)`); the n
choices of a prompt share its prefix in the KV cache (prefix caching). Every event lands in one queue
as (choice index, event). A client that goes away (the ASGI `http.disconnect`, watched
by a task of its own) aborts every choice still running: their KV blocks return within
a step, as a closed WebSocket's do.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import structlog

from protocol import Delta, Done, Error, ProtocolError
from service.engine.client import EngineClient, EngineRequest
from service.front.openai.errors import OpenAIError, from_protocol
from service.front.openai.logprobs import (TokenTexts, chat_logprobs, completion_logprobs,
                                           vllm_prompt_logprobs)
from service.front.openai.request import Plan

log = structlog.get_logger(__name__)
_encode = msgspec.json.Encoder().encode
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "abort",
          "error": "error"}


def _call_piece(part: Any) -> dict[str, Any]:
    """A `protocol.structured.ToolCallDelta` as OpenAI's chunk `tool_calls` entry."""
    piece: dict[str, Any] = {"index": part.index, "function": {"arguments": part.function.arguments}}
    if part.id is not None:
        piece["id"] = part.id
        piece["type"] = "function"
        piece["function"]["name"] = part.function.name
    return piece


def new_run_id(kind_id: str) -> str:
    """A response id, e.g. "chatcmpl-0da5..." (24 hex digits)."""
    return f"{kind_id}-{uuid.uuid4().hex[:24]}"


class Run:
    """The engine requests of one Plan. `await start()` admits every choice (all or none);
    then `body()` (not streamed) or `sse()` (streamed)."""

    def __init__(self, engine: EngineClient, plan: Plan, kind_id: str,
                 run_id: str | None = None) -> None:
        self.engine = engine
        self.plan = plan
        self.id = run_id or new_run_id(kind_id)
        self.created = int(time.time())
        self.model = engine.model_name
        self.keys: list[str] = []
        self.finished: set[int] = set()
        self.done: dict[int, Done] = {}
        self.texts: dict[int, list[str]] = {}
        self.calls: dict[int, list[Any]] = {}  # complete tool calls per choice (from Done)
        self.queue: asyncio.Queue[tuple[int, Delta | Error | Done]] = asyncio.Queue()
        self.error: OpenAIError | None = None
        # logprobs (when the plan asks): per choice, the scored ids and their scores
        # (prompt tokens first under echo), and the completions' running text offset
        self.logprobs = plan.params.get("logprobs") is not None
        self.scored: dict[int, tuple[list[int], list[Any]]] = {}
        self.offsets: dict[int, int] = {}
        self.token_texts = TokenTexts(engine.tokenizer) if self.logprobs else None
        # vLLM's return_token_ids / prompt_logprobs, and continuous usage: per choice
        self.prompt_tokens: dict[int, int] = {}
        self.prompt_ids: dict[int, list[int]] = {}
        self.prompt_scores: dict[int, list[Any]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    # ---- admission and cancel ------------------------------------------------------------
    async def start(self) -> None:
        """Admit every choice. Raises OpenAIError (the engine's refusal); the choices
        admitted before it are aborted."""
        plan = self.plan
        try:
            for i in range(plan.num_choices):
                prompt = plan.prompts[i // plan.n]
                params = dict(plan.params)
                if plan.n > 1 and params.get("seed") is not None:
                    params["seed"] = (params["seed"] + i % plan.n + 2**63) % 2**64 - 2**63
                key = f"{self.id}/{i}"
                self.keys.append(key)
                self.prompt_tokens[i] = await self.engine.add_request(EngineRequest(
                    **prompt, params=params, request_id=key, client_id=key,
                    connection_id=self.id, continue_final_message=plan.continue_final_message,
                    return_prompt_token_ids=plan.return_token_ids), self._sink(i))
        except ProtocolError as e:
            self.keys.pop()  # never queued
            self.abort()
            raise from_protocol(e, plan.renames,
                                "messages" if plan.kind == "chat" else "prompt") from None
        except BaseException:
            self.keys.pop()
            self.abort()
            raise

    def _sink(self, i: int) -> Callable[[Delta | Error | Done], None]:
        def sink(event: Delta | Error | Done) -> None:
            if isinstance(event, Done):
                self.finished.add(i)
            self.queue.put_nowait((i, event))
        return sink

    def abort(self) -> None:
        """Cancel every choice still running (each still ends with its Done)."""
        for i, key in enumerate(self.keys):
            if i not in self.finished:
                self.engine.abort(key)

    async def watch(self, receive: Callable[[], Awaitable[dict]]) -> None:
        """Abort when the client disconnects (the request body was read already)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                log.info("http_client_disconnected", request_id=self.id,
                         running=len(self.keys) - len(self.finished))
                self.abort()
                return

    async def events(self) -> AsyncIterator[tuple[int, Delta | Error | Done]]:
        """Every choice's events until each has its Done."""
        n = len(self.keys)
        ended = 0
        while ended < n:
            i, event = await self.queue.get()
            if isinstance(event, Done):
                ended += 1
                self.done[i] = event
            elif isinstance(event, Error) and self.error is None:
                self.error = from_protocol(event, self.plan.renames)
            elif isinstance(event, Delta):
                self._keep(i, event)
            yield i, event

    def _keep(self, i: int, event: Delta) -> None:
        """What a delta brings that the answer may show besides its text: the prompt's
        ids and scores, the completion's ids and their count (continuous usage)."""
        if event.prompt_token_ids is not None and i not in self.prompt_ids:
            self.prompt_ids[i] = event.prompt_token_ids
        if event.prompt_logprobs is not None and self.plan.return_prompt_logprobs:
            self.prompt_scores[i] = event.prompt_logprobs
        self.num_tokens[i] = self.num_tokens.get(i, 0) + len(event.token_ids)
        if self.plan.return_token_ids:
            self.token_ids.setdefault(i, []).extend(event.token_ids)

    # ---- what is sent ---------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        plan = self.plan
        firsts = [self.done[i] for i in range(0, plan.num_choices, plan.n) if i in self.done]
        prompt = sum(d.usage.prompt_tokens for d in firsts)
        cached = sum(d.usage.cached_tokens for d in firsts)
        completion = sum(d.usage.completion_tokens for d in self.done.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def running_usage(self) -> dict[str, Any]:
        """Usage so far (`stream_options.continuous_usage_stats`): every choice's prompt
        once per prompt, the completion tokens streamed until now."""
        plan = self.plan
        prompt = sum(self.prompt_tokens.get(i, 0) for i in range(0, plan.num_choices, plan.n))
        completion = sum(self.num_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def prompt_logprobs_of(self, i: int) -> list[Any] | None:
        """vLLM's prompt_logprobs of choice i's prompt (None: not asked or none came)."""
        scores = self.prompt_scores.get(i)
        if scores is None:
            return None
        texts = self.token_texts or TokenTexts(self.engine.tokenizer)
        return vllm_prompt_logprobs(self.prompt_ids.get(i, []), scores, texts,
                                    self.plan.params.get("prompt_logprobs") or 0)

    def echo_text(self, i: int) -> str:
        prompt = self.plan.prompts[i // self.plan.n]
        if "messages" in prompt:  # chat: the last message's content, when it is the answer's
            last = prompt["messages"][-1]
            return last["content"] if last["role"] == "assistant" else ""
        if "prompt" in prompt:
            return prompt["prompt"]
        return self.engine.tokenizer.decode(prompt["prompt_token_ids"])

    def _object(self, chunk: bool) -> str:
        if self.plan.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _choice(self, i: int, text: str | None, finish: str | None, first: bool = False,
                logprobs: dict[str, Any] | None = None,
                tool_calls: list[Any] | None = None) -> dict[str, Any]:
        if self.plan.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [_call_piece(p) for p in tool_calls]
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, i: int, ids: list[int], lps: list[Any]) -> dict[str, Any] | None:
        """The OpenAI logprobs object of these tokens of choice i (None: not asked)."""
        texts = self.token_texts
        if texts is None:
            return None
        if self.plan.kind == "chat":
            return chat_logprobs(ids, lps, texts)
        obj, self.offsets[i] = completion_logprobs(ids, lps, texts, self.offsets.get(i, 0))
        return obj

    def _score(self, i: int, event: Delta) -> None:
        """Keep a delta's scored tokens for the whole answer (not streamed)."""
        if not self.logprobs:
            return
        ids, lps = self.scored.setdefault(i, ([], []))
        if event.prompt_logprobs is not None and self.plan.echo:
            ids.extend(event.prompt_token_ids or ())
            lps.extend(event.prompt_logprobs)
        if event.logprobs:
            ids.extend(event.token_ids)
            lps.extend(event.logprobs)

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None,
               extra: dict[str, Any] | None = None) -> bytes:
        c: dict[str, Any] = {"id": self.id, "object": self._object(True),
                             "created": self.created, "model": self.model, "choices": choices}
        if extra:
            c.update(extra)
        if usage is None and self.plan.continuous_usage and choices:
            usage = self.running_usage()
        if self.plan.include_usage or self.plan.continuous_usage:
            c["usage"] = usage
        return b"data: " + _encode(c) + b"\n\n"

    def _ids_chunk(self, i: int, choice: dict[str, Any], event: Delta) -> bytes:
        """A content chunk of choice i; with return_token_ids its token_ids, and on the
        choice's first delta its prompt_token_ids (the chat response's top level, a
        completion choice's field; vLLM's placement)."""
        if self.plan.return_token_ids:
            choice["token_ids"] = list(event.token_ids)
            if event.prompt_token_ids is not None and self.plan.kind != "chat":
                choice["prompt_token_ids"] = event.prompt_token_ids
        return self._chunk([choice])

    def _role_chunks(self, i: int, event: Delta | Done | Error | None) -> Iterator[bytes]:
        """Chat: choice i's first chunk (the assistant role; with return_token_ids the
        prompt's ids at the chunk's top level, from the choice's first event, as vLLM
        sends them), then its echo."""
        ids = event.prompt_token_ids if isinstance(event, Delta) else None
        yield self._chunk([self._choice(i, "", None, first=True)],
                          extra={"prompt_token_ids": ids} if ids is not None else None)
        if self.plan.echo and self.echo_text(i):
            yield self._chunk([self._choice(i, self.echo_text(i), None)])

    async def sse(self) -> AsyncIterator[bytes]:
        """The SSE body: chunks, maybe a final error chunk, then `data: [DONE]`."""
        n = len(self.keys)
        # echo with logprobs: each choice's prompt goes with its scores, in its first delta
        echo_later = self.plan.echo and self.logprobs
        echoed: set[int] = set()
        # chat: the role chunks go first, at once; with return_token_ids each waits for
        # its choice's first event, which brings the prompt's ids
        role_later = self.plan.kind == "chat" and self.plan.return_token_ids
        started: set[int] = set()
        if self.plan.kind == "chat" and not role_later:
            for i in range(n):
                for chunk in self._role_chunks(i, None):
                    yield chunk
        elif self.plan.echo and not echo_later and self.plan.kind != "chat":
            for i in range(n):
                yield self._chunk([self._choice(i, self.echo_text(i), None)])
        try:
            async for i, event in self.events():
                if role_later and i not in started:
                    started.add(i)
                    for chunk in self._role_chunks(i, event):
                        yield chunk
                if echo_later and i not in echoed and not isinstance(event, Error):
                    echoed.add(i)
                    scores = None
                    if isinstance(event, Delta) and event.prompt_logprobs is not None:
                        scores = self._logprobs(i, event.prompt_token_ids or [],
                                                event.prompt_logprobs)
                    yield self._chunk([self._choice(i, self.echo_text(i), None,
                                                    logprobs=scores)])
                if isinstance(event, Delta):
                    scores = self._logprobs(i, event.token_ids, event.logprobs) \
                        if event.logprobs else None
                    if event.text or scores is not None or (
                            self.plan.return_token_ids and (event.token_ids or
                                                            event.prompt_token_ids)):
                        yield self._ids_chunk(i, self._choice(i, event.text, None,
                                                              logprobs=scores), event)
                    if event.tool_calls:
                        yield self._chunk([self._choice(i, None, None,
                                                        tool_calls=event.tool_calls)])
                elif isinstance(event, Done) and event.finish_reason != "error":
                    yield self._chunk([self._choice(i, None if self.plan.kind == "chat"
                                                    else "", FINISH[event.finish_reason])])
                elif isinstance(event, Done):
                    self.abort()
            if self.error is not None:
                yield b"data: " + _encode(self.error.body()) + b"\n\n"
            elif self.plan.include_usage:
                yield self._chunk([], self.usage())
            yield b"data: [DONE]\n\n"
        finally:
            self.abort()

    async def body(self) -> dict[str, Any]:
        """The whole answer (not streamed). Raises OpenAIError when a choice failed."""
        try:
            async for i, event in self.events():
                if isinstance(event, Delta):
                    self.texts.setdefault(i, []).append(event.text)
                    self._score(i, event)
                elif isinstance(event, Done) and event.finish_reason == "error":
                    self.abort()
                elif isinstance(event, Done) and event.tool_calls:
                    self.calls[i] = event.tool_calls
        finally:
            self.abort()
        if self.error is not None:
            raise self.error
        choices = []
        for i in range(len(self.keys)):
            text = "".join(self.texts.get(i, ()))
            finish = FINISH[self.done[i].finish_reason]
            scores = self._logprobs(i, *self.scored.get(i, ([], [])))
            if self.plan.echo:
                text = self.echo_text(i) + text
            if self.plan.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if i in self.calls:  # OpenAI: content null beside calls when there is none
                    message["content"] = text or None
                    message["tool_calls"] = [msgspec.to_builtins(c) for c in self.calls[i]]
                choice = {"index": i, "message": message, "logprobs": scores,
                          "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": scores,
                          "finish_reason": finish}
                if self.plan.return_prompt_logprobs:
                    choice["prompt_logprobs"] = self.prompt_logprobs_of(i)
                if self.plan.return_token_ids:
                    choice["prompt_token_ids"] = self.prompt_ids.get(i)
            if self.plan.return_token_ids:
                choice["token_ids"] = self.token_ids.get(i, [])
            choices.append(choice)
        body = {"id": self.id, "object": self._object(False), "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage(),
                "system_fingerprint": None}
        if self.plan.kind == "chat":  # one prompt: vLLM puts its fields at the top level
            if self.plan.return_prompt_logprobs:
                body["prompt_logprobs"] = self.prompt_logprobs_of(0)
            if self.plan.return_token_ids:
                body["prompt_token_ids"] = self.prompt_ids.get(0)
        return body
