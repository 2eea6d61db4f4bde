"""NullRunner: a `Runner` that computes nothing, instantly.

It "samples" `token_fn(request_id, position)` for every sequence that samples: its model
is certain of that token, and of each prompt's next token, so the logprobs it reports
(when a request's params ask) are 0.0 for that token and -inf for the others. The
scheduler-overhead benchmark uses it to time what the engine adds to a step besides
the forward; unit tests use it to drive EngineCore and the async Engine without a
model (vLLM's and nano-vllm's scheduler tests do the same with mock runners).
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.messages import TokenLogprob
from service.core.scheduler_output import RunnerOutput, SchedulerOutput

__all__ = ["NullRunner"]


class NullRunner:
    """Args:
        num_blocks, num_swap_blocks: the pool sizes to report; max_model_len: tokens.
        token_fn: (request id, completion position) -> token id; default: 42 always.

    Attributes for tests: `steps` (execute calls with sequences), `tokens` (tokens run),
    `calls` (each execute's request ids), `block_ops` (each apply_block_ops' output),
    `forgotten` (finished ids seen).
    """

    def __init__(self, num_blocks: int = 1024, num_swap_blocks: int = 0,
                 max_model_len: int = 4096,
                 token_fn: Callable[[str, int], int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.max_model_len = max_model_len
        self.token_fn = token_fn or (lambda rid, pos: 42)
        self.steps = 0
        self.tokens = 0
        self.calls: list[list[str]] = []
        self.block_ops: list[SchedulerOutput] = []
        self.forgotten: list[str] = []
        self._positions: dict[str, int] = {}

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        self.block_ops.append(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_request_ids:
            self._positions.pop(rid, None)
            self.forgotten.append(rid)
        if not out.sequences:
            return RunnerOutput({})
        self.steps += 1
        self.tokens += out.num_batched_tokens
        self.calls.append([s.request_id for s in out.sequences])
        sampled = {}
        lps: dict[str, TokenLogprob] = {}
        prompt_lps: dict[str, tuple[int, list[TokenLogprob]]] = {}
        for s in out.sequences:
            if s.sample:
                pos = self._positions.get(s.request_id, 0)
                token = sampled[s.request_id] = self.token_fn(s.request_id, pos)
                self._positions[s.request_id] = pos + 1
                if s.params.logprobs is not None:
                    lps[s.request_id] = _certain(token, s.params.logprobs)
            if s.prompt_token_ids is not None and s.params.prompt_logprobs is not None:
                start = s.num_computed_tokens
                end = min(start + len(s.token_ids), len(s.prompt_token_ids) - 1)
                prompt_lps[s.request_id] = (start, [
                    _certain(t, s.params.prompt_logprobs)
                    for t in s.prompt_token_ids[start + 1:end + 1]])
        return RunnerOutput(sampled, {}, lps, prompt_lps)


def _certain(token: int, k: int) -> TokenLogprob:
    """A distribution certain of `token`: it first in the top k, then other ids at -inf."""
    others = [(i, float("-inf")) for i in range(k) if i != token][:max(0, k - 1)]
    return TokenLogprob(0.0, ([(token, 0.0)] + others)[:k])
