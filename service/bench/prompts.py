"""Prompts of an exact length in model tokens, cut from real prose (`texts.py`).

The passages are tokenized once, as one text, into a ring of token ids:

    ids:  [A, Ġriver, Ġis, ..., Ġanything, ., ĊĊ]   (the last "\\n\\n" joins the end to the start)
    take(n) from start s:  ids[s], ids[s+1], ..., ids[(s+n-1) % len(ids)]

A start is always a word start (a token whose text begins with whitespace, or a
passage's first token), so a prompt decodes to prose beginning with a whole word. Starts
are drawn without replacement while unused ones remain, so two prompts of one workload
share no prefix (a server's prefix cache gets no accidental hits).
"""

from __future__ import annotations

import random

from service.bench.texts import PASSAGES, QUESTIONS, SYSTEM_PROMPT


class PromptSource:
    """Token-exact prompt material for one tokenizer.

    Args:
        tokenizer: a transformers tokenizer (the model's).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer.encode("\n\n".join(PASSAGES) + "\n\n",
                                               add_special_tokens=False)
        pieces = [tokenizer.decode([t]) for t in self.ids]
        # E.g. ['A', ' river', ' is', ',', ...]: offsets 0, 1, 2 are word starts, 3 is not.
        self.word_starts: list[int] = [
            i for i, p in enumerate(pieces)
            if i == 0 or p[:1].isspace() or pieces[i - 1].endswith("\n")
        ]

    def take(self, n: int, rng: random.Random, used: set[int]) -> list[int]:
        """`n` token ids of consecutive prose from a random word start not in `used`
        (any word start once all are used); the start is added to `used`.

        Raises ValueError for n < 1.
        """
        if n < 1:
            raise ValueError(f"a prompt needs >= 1 token, got {n}")
        free = [s for s in self.word_starts if s not in used] or self.word_starts
        start = rng.choice(free)
        used.add(start)
        size = len(self.ids)
        return [self.ids[(start + k) % size] for k in range(n)]

    def chat_ids(self, system: str | None, user: str) -> list[int]:
        """Token ids of a chat (system turn optional) with the generation prompt added."""
        turns = ([{"role": "system", "content": system}] if system is not None else [])
        turns.append({"role": "user", "content": user})
        return chat_token_ids(self.tokenizer, turns)

    def system_prompt(self, n: int) -> str:
        """The first ~`n` tokens of SYSTEM_PROMPT as text (cut at a token boundary, so
        re-tokenizing gives n tokens, give or take one at the cut). Raises ValueError
        for n < 1 or n beyond the prompt's length."""
        ids = self.tokenizer.encode(SYSTEM_PROMPT, add_special_tokens=False)
        if not 1 <= n <= len(ids):
            raise ValueError(f"the system prompt has {len(ids)} tokens; asked for {n}")
        return self.tokenizer.decode(ids[:n]).strip()

    @staticmethod
    def question(i: int) -> str:
        """A distinct user question for request `i` (cycles through QUESTIONS with a
        ticket number, so no two requests are identical)."""
        return f"Ticket {1000 + i}: {QUESTIONS[i % len(QUESTIONS)]}"


def chat_token_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Token ids of chat `turns` ({"role", "content"} dicts) with the generation prompt
    added, tokenized exactly as the server tokenizes `messages` (template to text, then
    encode without special tokens)."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
