"""NullRunner: a `Runner` that computes nothing, instantly.

It "samples" `token_fn(request_id, position)` for every sequence that samples. The
scheduler-overhead benchmark uses it to time what the engine adds to a step besides
the forward; unit tests use it to drive EngineCore and the async Engine without a
model (vLLM's and nano-vllm's scheduler tests do the same with mock runners).
"""

from __future__ import annotations

from collections.abc import Callable

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
        for s in out.sequences:
            if s.sample:
                pos = self._positions.get(s.request_id, 0)
                sampled[s.request_id] = self.token_fn(s.request_id, pos)
                self._positions[s.request_id] = pos + 1
        return RunnerOutput(sampled)
