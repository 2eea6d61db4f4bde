"""A request's input: checked exactly as the wire checks it, then tokenized (Admission's
first half; `service.engine.admission` runs it).

Checking (`coerce_params`, `coerce_messages`, `coerce_token_ids`): `conveyor serve`
decodes frames with msgspec, which enforces every range that `protocol.messages`
declares. The in-process API (`Engine.add_request`,
`Engine.generate`, `LLM`) takes Python objects instead: plain dicts, as vLLM's
`LLM.chat` and OpenAI-style clients pass them, or our Structs, which Python can
construct without any check. Both go through `msgspec.convert` against the same
Structs here, so a value the wire refuses is refused in-process too, with the
same `InvalidRequest` and the same JSON path (`$.params.temperature`), before
anything is queued.

Tokenizing (`PromptTokenizer`): a request's prompt (chat messages, raw text or token ids)
into token ids. Chat messages are the one place where text from a client meets the
template's control tokens. Rendering the template and tokenizing the result as one string
would parse `<|im_end|>` typed inside a message as the real control token, so a
user could close their own turn and open a forged `system` one. Instead the
template is rendered with a placeholder for each message's content, the rendered
text is split at the placeholders, the template's own scaffolding is tokenized
with special-token parsing and every content with none (its markers cost their
ordinary BPE pieces), and the pieces are joined. Roles are checked against the
roles the template knows. Raw `prompt` text keeps special-token parsing: it is
the caller's whole prompt, template included.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from protocol import ChatMessage, InvalidRequest, SamplingParams
from protocol.messages import TokenId
from service.engine.constraints.tools import ToolPlan, history_turns, template_tool_style

if TYPE_CHECKING:
    from protocol.structured import Tool, ToolChoiceFunction

__all__ = ["PromptTokenizer", "coerce_messages", "coerce_params", "coerce_token_ids",
           "invalid_at"]


def invalid_at(e: msgspec.ValidationError, prefix: str, request_id: str | None) -> InvalidRequest:
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
        raise invalid_at(e, "$.params", request_id) from None


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
        raise invalid_at(e, "$.messages", request_id) from None
    if not turns:
        raise InvalidRequest("messages must hold at least one turn", param="$.messages",
                             request_id=request_id)
    for i, t in enumerate(turns):
        if t.content is None and not (t.role == "assistant" and t.tool_calls):
            raise InvalidRequest(f"$.messages[{i}]: a turn needs `content` (only an assistant "
                                 "turn that calls tools may leave it out)",
                                 param=f"$.messages[{i}]", request_id=request_id)
    # None content (an assistant turn that only called tools) reads as ""
    return [t if t.content is not None else msgspec.structs.replace(t, content="")
            for t in turns]


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
        raise invalid_at(e, "$.prompt_token_ids", request_id) from None




# Roles that ChatML-style templates (which pass `role` through) are used with.
DEFAULT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_ROLE_LITERAL = re.compile(r"""role['"]?\]?\s*==\s*['"]([A-Za-z_][\w-]*)['"]""")
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")  # private-use characters: never in a template


def _placeholder(i: int) -> str:
    return f"\ue000{i}\ue001"


class PromptTokenizer:
    """Prompt -> token ids for one model; thread-safe (admission runs it in a thread pool).

    Args:
        tokenizer: a transformers fast tokenizer (with `backend_tokenizer`).
        vocab_size: ids must be < this.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        backend = tokenizer.backend_tokenizer
        self._backend = backend
        # A private copy that never parses special tokens: message contents go through it
        # (setting the flag on the shared backend per call would race between threads).
        self._plain = copy.deepcopy(backend)
        self._plain.encode_special_tokens = True
        template = getattr(tokenizer, "chat_template", None) or ""
        self.roles = DEFAULT_ROLES | frozenset(_ROLE_LITERAL.findall(template))
        # Added tokens (control tokens like <|im_start|>): the normal encode parses them.
        added = backend.get_added_tokens_decoder()
        self._added_ids = {t.content: i for i, t in added.items()}
        self._strip = {t.content: (t.lstrip, t.rstrip) for t in added.values()}
        self._added_texts = tuple(sorted(self._added_ids, key=len, reverse=True))
        self._added = re.compile("|".join(map(re.escape, self._added_texts))) \
            if self._added_texts else None
        vocab = backend.get_vocab()
        try:
            longest = max(len(tokenizer.convert_tokens_to_string([t])) for t in vocab)
        except Exception:  # a tokenizer whose pieces cannot be decoded one by one
            longest = 0
        self.max_chars_per_token = max(longest, max(map(len, self._added_texts), default=0))
        # how tools reach this template (service.engine.constraints.tools)
        self.tool_style = template_tool_style(tokenizer)

    def tool_plan(self, tools: Sequence[Tool] | None,
                  tool_choice: str | ToolChoiceFunction | None, *, parallel: bool = False,
                  request_id: str | None = None) -> ToolPlan | None:
        """How `tools` reach this model's prompt and output (`ToolPlan.make` in this
        template's style): for a caller that renders the prompt itself (the Responses API's
        chained prompts). None when no tool may be called. Raises InvalidRequest as
        `ToolPlan.make` does."""
        return ToolPlan.make(tools, tool_choice, self.tool_style, request_id,
                             parallel=parallel)

    # ---- cheap checks, before any tokenizing --------------------------------------------
    def min_tokens(self, *, messages: Sequence[ChatMessage] | None = None,
                   prompt: str | None = None,
                   token_ids: Sequence[int] | None = None) -> int:
        """A lower bound on the prompt's length in tokens, in O(number of messages).

        No token decodes to more than `max_chars_per_token` characters, so n characters
        need at least n / max_chars_per_token tokens; halved again as a margin for
        normalizers that drop characters. 0 when the tokenizer gives no bound.
        """
        if token_ids is not None:
            return len(token_ids)
        if not self.max_chars_per_token:
            return 0
        chars = len(prompt) if prompt is not None else \
            sum(len(m.content or "") for m in messages or ())
        return chars // (2 * self.max_chars_per_token)

    # ---- tokenizing ----------------------------------------------------------------------
    def __call__(self, *, messages: Sequence[ChatMessage] | None = None,
                 prompt: str | None = None, token_ids: Sequence[int] | None = None,
                 request_id: str | None = None, continue_final: bool = False,
                 tools: ToolPlan | None = None) -> list[int]:
        """Token ids of exactly one of `messages` (chat template with the generation prompt
        added; `tools` rendered by the template or in the system prompt, as the plan says),
        `prompt` (raw text, no template, special tokens parsed) or `token_ids`.
        continue_final: the messages' template without a generation prompt, cut right
        after the last message's content, which the output then continues (vLLM's and
        transformers' `continue_final_message`).

        Raises InvalidRequest (with the JSON path of the field) for zero or several prompt
        forms, out-of-vocabulary ids, an unknown role, a template that fails, or a prompt
        of zero tokens.
        """
        given = sum(x is not None for x in (messages, prompt, token_ids))
        if given != 1:
            raise InvalidRequest("exactly one of messages, prompt, prompt_token_ids must be "
                                 "given", request_id=request_id)
        if token_ids is not None:
            ids = [int(t) for t in token_ids]
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"token id {ids[bad]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", param=f"$.prompt_token_ids[{bad}]",
                                     request_id=request_id)
            param = "$.prompt_token_ids"
        elif prompt is not None:
            ids = self._backend.encode(prompt, add_special_tokens=False).ids
            param = "$.prompt"
        else:
            assert messages is not None
            ids = self._chat(messages, request_id, add_generation_prompt=not continue_final,
                             cut_after_last=continue_final, tools=tools)
            param = "$.messages"
        if not ids:
            raise InvalidRequest("the prompt has zero tokens", param=param, request_id=request_id)
        return ids

    def chat_ids(self, messages: Sequence[ChatMessage], *, after: int | None = None,
                 add_generation_prompt: bool = True, request_id: str | None = None,
                 tools: ToolPlan | None = None) -> list[int]:
        """Token ids of the chat template over `messages`, tokenized as `__call__` does
        (contents as plain text). With `after=k`, only the ids of the text that follows the
        content of `messages[k]`: the continuation of a context that ends with that content
        (the Responses API's `previous_response_id`, service/front/ws/responses/). E.g. ChatML with
        k the last assistant turn and a new user turn: the ids of
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n".

        Raises InvalidRequest (param "$.messages...") as `__call__` does.
        """
        if after is not None and not 0 <= after < len(messages):
            raise ValueError(f"after must index messages (0..{len(messages) - 1}), got {after}")
        return self._chat(messages, request_id, after=after,
                          add_generation_prompt=add_generation_prompt, tools=tools)

    def _chat(self, messages: Sequence[ChatMessage], request_id: str | None, *,
              after: int | None = None, add_generation_prompt: bool = True,
              cut_after_last: bool = False, tools: ToolPlan | None = None) -> list[int]:
        for i, m in enumerate(messages):
            if m.role not in self.roles:
                raise InvalidRequest(f"role {m.role[:64]!r} is not one this model's chat template "
                                     f"knows ({', '.join(sorted(self.roles))})",
                                     param=f"$.messages[{i}].role", request_id=request_id)
        # past tool calls and results in the template's style; the generic tool prompt in
        # the system turn (a new first turn shifts the others by one)
        turns = history_turns(messages, self.tool_style,
                              tools.system_prompt() if tools is not None else None)
        if after is not None:
            after += len(turns) - len(messages)
        template_tools = tools.template_tools() if tools is not None else None
        self._check_scaffold(turns, template_tools, request_id)
        masked = self._render([{**t, "content": _placeholder(i)} for i, t in enumerate(turns)],
                              request_id, add_generation_prompt, template_tools)
        pieces = _PLACEHOLDER.split(masked)  # [scaffold, index, scaffold, index, ..., scaffold]
        # The real text, and the spans of the control tokens the template itself wrote:
        # only those become control tokens. E.g. pieces ["<|im_start|>user\n", "0",
        # "<|im_end|>\n"] with content "Hi" -> text "<|im_start|>user\nHi<|im_end|>\n",
        # control spans [(0, 12), (19, 29)]; "user\nHi" and "\n" are plain text.
        text, controls = [], []
        offset = begin = 0  # begin: where the ids start (after the content of `after`)
        cut = None  # cut_after_last: where the last message's content ends
        for k, piece in enumerate(pieces):
            if k % 2:
                index = int(piece)
                piece = turns[index]["content"]
                if index == after:
                    begin = offset + len(piece)
                if index == len(turns) - 1:
                    cut = offset + len(piece)
            elif self._added is not None:
                controls += [(offset + m.start(), offset + m.end())
                             for m in self._added.finditer(piece)]
            text.append(piece)
            offset += len(piece)
        real = "".join(text)
        rendered = self._render(turns, request_id, add_generation_prompt, template_tools)
        if cut_after_last:
            if cut is None:
                raise InvalidRequest("continue_final_message: the chat template does not "
                                     "render the last message's content",
                                     param="$.messages", request_id=request_id)
            controls = [c for c in controls if c[1] <= cut]
            real, rendered = real[:cut], rendered[:cut]
        if real != rendered:
            # The template rewrites contents (e.g. `| trim`): pieces cannot be told apart,
            # so refuse control-token text in any content rather than parse it.
            for i, m in enumerate(messages):
                hit = next((s for s in self._added_texts if s in (m.content or "")), None)
                if hit is not None:
                    raise InvalidRequest(f"message content may not contain the control token "
                                         f"{hit!r} with this model's chat template",
                                         param=f"$.messages[{i}].content", request_id=request_id)
            return self._backend.encode(real[begin:], add_special_tokens=False).ids
        # Tokenize as the tokenizer would (split at control tokens, then each stretch of
        # text in one piece, so word boundaries match), but split only at the template's.
        ids: list[int] = []
        pos = begin
        for start, end in [c for c in controls if c[0] >= begin] + [(len(real), len(real))]:
            token = real[start:end]
            lstrip, rstrip = self._strip.get(token, (False, False))
            stretch = real[pos:start]
            if lstrip:  # the token swallows the whitespace before it (AddedToken.lstrip)
                stretch = stretch.rstrip()
            if stretch:
                ids += self._plain.encode(stretch, add_special_tokens=False).ids
            if token:
                ids.append(self._added_ids[token])
            pos = end
            if rstrip:  # ... or after it
                while pos < len(real) and real[pos].isspace() and \
                        not any(s <= pos < e for s, e in controls):
                    pos += 1
        return ids

    def _check_scaffold(self, turns: list[dict[str, Any]], tools: list[Any] | None,
                        request_id: str | None) -> None:
        """Tools and past calls that a native template writes itself are scaffold, not
        placeholders: refuse control-token text in them (it would parse as the token)."""
        if self._added is None:
            return
        if tools is not None:
            hit = self._added.search(json.dumps(tools, ensure_ascii=False))
            if hit is not None:
                raise InvalidRequest(f"tools may not contain the control token {hit.group()!r}",
                                     param="$.tools", request_id=request_id)
        for i, t in enumerate(turns):
            extra = {k: v for k, v in t.items() if k not in ("role", "content")}
            if extra:
                hit = self._added.search(json.dumps(extra, ensure_ascii=False))
                if hit is not None:
                    raise InvalidRequest(f"a tool call or result may not contain the control "
                                         f"token {hit.group()!r}", param="$.messages",
                                         request_id=request_id)

    def _render(self, turns: list[dict[str, Any]], request_id: str | None,
                add_generation_prompt: bool = True, tools: list[Any] | None = None) -> str:
        try:
            if tools is not None:
                return self.tokenizer.apply_chat_template(
                    turns, tools=tools, tokenize=False,
                    add_generation_prompt=add_generation_prompt)
            return self.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors: e.g. roles out of order for this template
            raise InvalidRequest(f"the chat template rejected the messages: {e}",
                                 param="$.messages", request_id=request_id) from None
