"""A request's life inside the engine: tokens, progress, blocks, timings.

Token regions of one request (num_tokens = prompt + output so far):

    |<------------- prompt_token_ids ------------->|<--- output_token_ids --->|
    |<-- num_cached -->|                                                      |
    |<----------------- num_computed_tokens ---------------->|                |
                                                             ^ next chunk starts here

Each step the scheduler gives a request a token budget so that num_computed_tokens
catches up with num_tokens; when it does, the step samples one more token. A
preempted request (recompute) drops its blocks and sets num_computed_tokens to 0:
its prompt and output so far are prefilled again; nothing already sent changes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec

from protocol.messages import DEFAULT_MAX_TOKENS, SamplingParams, TokenLogprob
from service.core.scheduler_output import TokenConstraint


def uses_logits_processors(params: SamplingParams) -> bool:
    """Whether params ask for a per-row logits processor (presence / frequency /
    repetition penalty, logit_bias, min_tokens; `service.worker.logits_processors`)."""
    rep = params.repetition_penalty
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias
                or params.min_tokens or (rep is not None and rep != 1.0))


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # never scheduled yet
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks dropped: recompute from token 0 on resume
    SWAPPED = "swapped"      # blocks copied to CPU swap space: copied back on resume
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one generation request (owned by EngineCore; pure data).

    arrival_time and the other times are `time.monotonic()` seconds. A seeded request's
    random generator is the model runner's (it keys them by request id).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    cpu_block_ids: list[int] = field(default_factory=list)  # while SWAPPED
    num_cached_tokens: int = -1  # prefix cache hit at first schedule; -1 = not scheduled yet
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those read from the disk tier
    # disk tier (service.core.disk_prefix): stable digests of full blocks, whether this
    # wait's lookup ran, a load in flight, and which blocks [start, end) the last load put
    # in the pool
    disk_digests: list[bytes] = field(default_factory=list)
    disk_checked: bool = False
    disk_loading: bool = False
    disk_block_range: tuple[int, int] | None = None
    disk_noted_blocks: int = 0  # leading full blocks already noted for the disk tier
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    stop_token_id: int | None = None  # the EOS / stop token that ended it (not delivered)
    # params.prompt_logprobs: index i scores prompt token i (None for token 0), gathered
    # chunk by chunk, delivered once with the first output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # (prompt, output) token lists -- these very lists -- handed to the runner with each
    # sampling step when the params ask for a logits processor that reads them (penalties,
    # logit_bias, min_tokens); None otherwise (set once, in __post_init__)
    token_history: tuple[list[int], list[int]] | None = None
    # structured output / tool calls: the grammar state the runner masks this request's
    # samples with (bound to output_token_ids, which is why that list is never replaced)
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        # Admission fills an unset max_tokens (the model's max_new_tokens, fitted to the
        # prompt); a Request built without admission (tests, benches) gets the wire's 256.
        if self.params.max_tokens is None:
            self.params = msgspec.structs.replace(self.params, max_tokens=DEFAULT_MAX_TOKENS)
        if uses_logits_processors(self.params):
            self.token_history = (self.prompt_token_ids, self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the last sampled token, or None: EOS/stop id -> "stop",
        max_tokens or the context cap -> "length". Stop strings are the detokenizer's.

        A stop token is not part of the completion: it is taken off `output_token_ids`
        (so usage counts what is delivered) and kept in `stop_token_id`."""
        last = self.output_token_ids[-1]
        if (not self.params.ignore_eos and last in self.eos_token_ids) or \
                last in self.params.stop_token_ids:
            self.stop_token_id = self.output_token_ids.pop()
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
