"""One benchmark request: what is sent, and how long its prompt and completion are."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """A request of a workload, before it is sent.

    index: position in the workload (0-based); the wire id is `id` ("b<index>").
    prompt_token_ids: the prompt as the model sees it (chat template applied when the
        request is a chat), so its length is the input length in model tokens and the
        in-process peers can run exactly the same tokens.
    max_tokens: completion length asked for (>= 1); with ignore_eos it is exactly the
        completion length.
    messages / prompt: the wire form when the request came from a JSONL file (chat turns
        as (role, content) pairs, or raw text); both None means `prompt_token_ids` is sent.

    Raises ValueError for an empty prompt, max_tokens < 1 or both wire forms given.
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    messages: tuple[tuple[str, str], ...] | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.index}: the prompt has zero tokens")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.index}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.messages is not None and self.prompt is not None:
            raise ValueError(f"request {self.index}: give messages or prompt, not both")

    @property
    def id(self) -> str:
        return f"b{self.index}"

    @property
    def input_len(self) -> int:
        """Prompt length in model tokens."""
        return len(self.prompt_token_ids)

    def wire(self) -> dict[str, object]:
        """The prompt keyword of `Client.generate`: messages=, prompt= or prompt_token_ids=."""
        if self.messages is not None:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages]}
        if self.prompt is not None:
            return {"prompt": self.prompt}
        return {"prompt_token_ids": list(self.prompt_token_ids)}
