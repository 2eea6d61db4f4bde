"""A Responses turn's prompt: token ids that continue the previous response's exact tokens.

With `previous_response_id`, the engine's prompt for turn N+1 is turn N's context
(its prompt + output token ids, as sampled, not re-tokenized) followed by the ids of
the chat-template text that comes after it: the end of turn N's last message, the new
input items, and the generation prompt. So every full KV block of turn N is a prefix
cache hit on turn N+1. For ChatML (SmolLM2):

    turn N context:   <|im_start|>system ...<|im_start|>user\\nQ1<|im_end|>\\n<|im_start|>assistant\\nA1
    turn N+1 adds:    <|im_end|>\\n<|im_start|>user\\nQ2<|im_end|>\\n<|im_start|>assistant\\n

A warm-up (`generate: false`) prefills its context only up to the end of its last
item's content (no end-of-turn, no generation prompt), so the turn that continues it
shares every one of those tokens. When a turn's `instructions` differ from those its
predecessor was rendered with, the conversation is rendered anew from its messages
(instructions are not carried over, as OpenAI documents; the cache then hits only
where the tokens still agree). So it is when the tools render differently (other tools,
another tool_choice: the generic style's tool prompt opens the system turn, a native
template renders its tool list at the top): `tools_key` tells them apart.

A turn that called functions is kept as the assistant's raw text (the calls as the model
wrote them), so the text that follows its content is the same in either case; a native
template would render a `tool_calls` turn's calls after its content. The generic style's
turn that brings the functions' results is the exception: it renders the conversation
anew, its past calls as sentences (a small model shown its own call envelope calls
again; `tools.history_turns`), and the cache hits up to the call.
"""

from __future__ import annotations

import json
import weakref
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protocol import ChatMessage
from service.engine.request_input import PromptTokenizer
from service.front.ws.responses.store import StoredResponse

if TYPE_CHECKING:
    from service.engine.constraints.tools import ToolPlan

__all__ = ["build_prompt", "context_after", "prompt_tokenizer", "tools_key"]

_tokenizers: weakref.WeakKeyDictionary[Any, PromptTokenizer] = weakref.WeakKeyDictionary()


def prompt_tokenizer(tokenizer: Any) -> PromptTokenizer:
    """One PromptTokenizer per tokenizer, shared by every connection (thread-safe; the
    first call builds it, about a second: call it off the event loop)."""
    pt = _tokenizers.get(tokenizer)
    if pt is None:
        pt = _tokenizers[tokenizer] = PromptTokenizer(tokenizer, len(tokenizer))
    return pt


def tools_key(plan: ToolPlan | None) -> str | None:
    """What the prompt shows of the tools: the generic style's tool prompt, or a native
    template's tool list (None: no tools shown)."""
    if plan is None:
        return None
    prompt = plan.system_prompt()
    if prompt is not None:
        return prompt
    return json.dumps(plan.template_tools(), sort_keys=True, ensure_ascii=False)


def _turns(instructions: str | None, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    return ([ChatMessage("system", instructions)] if instructions else []) + list(messages)


def _up_to_last_content(pt: PromptTokenizer, turns: list[ChatMessage],
                        ids: list[int], tools: ToolPlan | None) -> list[int]:
    """`ids` (rendered without a generation prompt) cut after the last turn's content."""
    tail = pt.chat_ids(turns, after=len(turns) - 1, add_generation_prompt=False, tools=tools)
    if tail and ids[-len(tail):] == tail:
        return ids[:-len(tail)]
    return ids


def _generic_results(tools: ToolPlan | None, new: Sequence[ChatMessage]) -> bool:
    """The generic tool style gets function results: its past calls are rendered anew as
    sentences (`tools.history_turns`), not kept as the envelope the model wrote."""
    return tools is not None and not tools.native and any(m.role == "tool" for m in new)


def build_prompt(pt: PromptTokenizer, previous: StoredResponse | None,
                 instructions: str | None, new: Sequence[ChatMessage], *,
                 generate: bool, tools: ToolPlan | None = None
                 ) -> tuple[list[int], tuple[ChatMessage, ...]]:
    """(prompt token ids, the conversation's messages including `new`) for one turn.

    previous: the response this turn continues, or None. generate: False for a warm-up
    (no generation prompt; the context ends with the last new item's content). tools:
    the tools the prompt shows (None: none).
    Raises InvalidRequest (from the chat template: an unknown role, ...) naming
    "$.messages[i]" of the turns as rendered.
    """
    history = previous.messages if previous is not None else ()
    messages = tuple(history) + tuple(new)
    turns = _turns(instructions, messages)
    if previous is not None and previous.instructions == instructions and history \
            and previous.tools_key == tools_key(tools) and not _generic_results(tools, new):
        k = len(turns) - len(new) - 1  # the turn whose content ends previous's context
        ids = list(previous.token_ids)
        if generate:
            suffix = pt.chat_ids(turns, after=k, add_generation_prompt=True, tools=tools)
        elif new:
            suffix = _up_to_last_content(
                pt, turns, pt.chat_ids(turns, after=k, add_generation_prompt=False,
                                       tools=tools), tools)
        else:  # a warm-up with nothing new: the context as it is
            suffix = []
        return ids + suffix, messages
    ids = pt.chat_ids(turns, add_generation_prompt=generate, tools=tools)
    if not generate:
        ids = _up_to_last_content(pt, turns, ids, tools)
    return ids, messages


def context_after(response_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  messages: tuple[ChatMessage, ...], instructions: str | None,
                  special_ids: frozenset[int], key: str | None = None) -> StoredResponse:
    """The context a completed turn leaves: its prompt + output ids without the trailing
    special tokens (EOS: the template's own end of turn follows in the next prompt); key:
    how its prompt rendered the tools (`tools_key`)."""
    out = list(output_ids)
    while out and out[-1] in special_ids:
        out.pop()
    return StoredResponse(response_id, messages, instructions,
                          array("i", list(prompt_ids) + out), key)
