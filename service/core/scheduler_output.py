"""The only contract between the scheduler and the model runner, both ways (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from protocol.messages import SamplingParams, TokenLogprob


class TokenConstraint(Protocol):
    """What the runner needs of a constrained request's grammar state (structured output,
    tool calls): `service.worker.grammar_state.GrammarState` is the one kind. Opaque to the
    core, which only carries it from the Request to the runner.

    It follows the request's own output token list (bound when it was made), so it is
    right after any step, preemption by recompute or swap included: `fill_mask` first
    consumes the tokens accepted since its last call (or rolls back and replays when the
    list got shorter), then writes which tokens may come next.
    """

    def fill_mask(self, ptr: int, nbytes: int) -> str | None:
        """Write the next-token bitmask (int32 words, bit t%32 of word t//32 is token t)
        into `nbytes` bytes at address `ptr`; return None, or why no token may follow."""
        ...


class ScheduledSequence(NamedTuple):
    """One sequence's share of a step (a NamedTuple: built for every sequence every step).

    token_ids: the tokens whose K/V this step computes, [n] (a prefill chunk, or 1 for a decode).
    num_computed_tokens: tokens of this sequence already in the KV cache before them.
    block_table: the sequence's KV block ids, covering num_computed_tokens + n tokens (the
        request's own list: read it, never change it; valid until the next schedule()).
    sample: True when this chunk reaches the sequence's last token, so a new token is sampled.
    params: the request's sampling parameters (a seeded request's generator is the
        runner's, keyed by request_id).
    prompt_token_ids: the request's whole prompt (its own list, read only) while it asks
        for prompt logprobs and has none yet, else None: the runner scores each prompt
        position of this chunk against the prompt's next token.
    token_history: (prompt, output so far) -- the request's own lists, read only -- on a
        sampling chunk of a request whose params ask for a logits processor (penalties,
        logit_bias, min_tokens), else None.
    constraint: the request's grammar state when its output is constrained (structured
        output, tool calls), else None: the runner masks the sampled row with it.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    token_history: tuple[list[int], list[int]] | None = None
    constraint: TokenConstraint | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step does, in this order: swap out, swap in, copy blocks, forward.

    swap_out: (device block, CPU block) pairs to copy to CPU before anything else.
    swap_in: (CPU block, device block) pairs to copy back.
    copy_blocks: (source, destination) device blocks for copy-on-write.
    preempted: request ids preempted while building this step.
    finished_request_ids: requests that ended since the previous step: the runner drops
        what it keeps per request (random generators), as vLLM's `finished_req_ids`.
    """

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    finished_request_ids: tuple[str, ...] = ()

    @property
    def has_block_ops(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy_blocks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no sequence and no block copy (finished ids alone are no work)."""
        return not self.sequences and not self.has_block_ops


class RunnerOutput(NamedTuple):
    """What the runner hands back for one step.

    sampled: request id -> the token sampled for it (sequences with `sample` only).
    failed: request id -> why its row failed (e.g. non-finite logits); the rest of the
        batch is unaffected.
    logprobs: request id -> the sampled token's logprobs (requests whose params ask).
    prompt_logprobs: request id -> (p, scores): scores[i] is that of prompt token p + 1 + i
        (computed from position p + i), for the prompt positions of this step's chunk.
    """

    sampled: dict[str, int]
    failed: dict[str, str] = {}
    logprobs: dict[str, TokenLogprob] = {}
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}
