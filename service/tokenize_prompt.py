"""Turn a request's prompt (chat messages, raw text or token ids) into token ids."""

from __future__ import annotations

from collections.abc import Sequence

from protocol import ChatMessage, InvalidRequest


def tokenize_prompt(tokenizer, vocab_size: int, *, messages: Sequence[ChatMessage] | None,
                     prompt: str | None, token_ids: Sequence[int] | None,
                     request_id: str | None = None) -> list[int]:
    """Token ids of exactly one of `messages` (chat template with the generation prompt
    added), `prompt` (raw text, no template) or `token_ids` (each < vocab_size).

    Raises InvalidRequest (with the JSON path of the field) for zero or several prompt
    forms, out-of-vocabulary ids, a template that fails, or a prompt of zero tokens.
    """
    given = sum(x is not None for x in (messages, prompt, token_ids))
    if given != 1:
        raise InvalidRequest("exactly one of messages, prompt, prompt_token_ids must be given",
                             request_id=request_id)
    if token_ids is not None:
        ids = [int(t) for t in token_ids]
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {ids[bad]} is outside the vocabulary [0, {vocab_size})",
                                 param=f"$.prompt_token_ids[{bad}]", request_id=request_id)
        param = "$.prompt_token_ids"
    elif prompt is not None:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        param = "$.prompt"
    else:
        assert messages is not None
        turns = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors: e.g. roles out of order for this template
            raise InvalidRequest(f"the chat template rejected the messages: {e}",
                                 param="$.messages", request_id=request_id) from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        param = "$.messages"
    if not ids:
        raise InvalidRequest("the prompt has zero tokens", param=param, request_id=request_id)
    return ids
