"""What `scripts/bench --real-sizes` sends to each server, and the context both get.

Three phases, run in this order on one fresh server per (file, server):

    one-user    `one_user_requests` requests of `one_user_input` prompt tokens and
                `one_user_output` output tokens, one at a time (after 1 untimed warm-up)
    concurrent  `concurrent` requests all at once, medium's lengths (prompts of 100-500
                tokens, 50-200 output tokens, seeded)
    long        one prompt of `long_prompt` tokens, `long_output` output tokens: its TTFT

Every prompt is real prose from its own word start (`prompts.PromptSource`, one `used`
set for all phases), so the long prompt shares no prefix with what came before: a cold
prefill on both servers. All greedy with ignore_eos.

Context, the same for both: `slot_ctx` tokens per sequence (the longest request, rounded
up to 256: 2,000 + 1 -> 2,048) and `concurrent` sequences, `ctx_total` = slot_ctx x
concurrent tokens of KV in all (llama-server `-np concurrent -c ctx_total`; Conveyor
`--max-num-seqs concurrent --max-model-len slot_ctx --num-kv-blocks ctx_total / 16
--block-size 16`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from service.bench.llama_server import slot_context
from service.bench.plan import LoadPlan
from service.bench.prompts import PromptSource
from service.bench.request_spec import RequestSpec

BLOCK_SIZE = 16
PHASES = ("one_user", "concurrent", "long")


@dataclass(frozen=True)
class RealSizesConfig:
    """The lengths and counts of the three phases (module docstring); `seed` draws the
    prompts and the concurrent lengths. Raises ValueError for a value out of range."""

    one_user_requests: int = 3
    one_user_input: int = 100
    one_user_output: int = 64
    concurrent: int = 8
    long_prompt: int = 2000
    long_output: int = 1
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("one_user_requests", "one_user_input", "one_user_output", "concurrent",
                     "long_prompt", "long_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class Phases:
    """The three phases' plans and the context they need (module docstring)."""

    one_user: LoadPlan
    concurrent: LoadPlan
    long: LoadPlan

    @property
    def slot_ctx(self) -> int:
        specs = [s for p in (self.one_user, self.concurrent, self.long) for s in p.requests]
        return slot_context([s.input_len for s in specs], [s.max_tokens for s in specs])

    @property
    def n_seqs(self) -> int:
        return self.concurrent.max_concurrency or len(self.concurrent.requests)

    @property
    def ctx_total(self) -> int:
        return self.slot_ctx * self.n_seqs

    def conveyor_args(self) -> list[str]:
        """The `conveyor serve` flags that give Conveyor the same context as llama-server."""
        return ["--max-num-seqs", str(self.n_seqs), "--max-model-len", str(self.slot_ctx),
                "--block-size", str(BLOCK_SIZE),
                "--num-kv-blocks", str(self.ctx_total // BLOCK_SIZE)]


def build_phases(tokenizer, cfg: RealSizesConfig) -> Phases:
    """The phases' plans in `tokenizer`'s tokens (module docstring)."""
    rng = random.Random(cfg.seed)
    source = PromptSource(tokenizer)
    used: set[int] = set()

    def specs(lengths: list[tuple[int, int]]) -> tuple[RequestSpec, ...]:
        return tuple(RequestSpec(i, tuple(source.take(n_in, rng, used)), n_out)
                     for i, (n_in, n_out) in enumerate(lengths))

    def plan(reqs: tuple[RequestSpec, ...], concurrency: int, warmup: int) -> LoadPlan:
        return LoadPlan(reqs, (0.0,) * len(reqs), max_concurrency=concurrency,
                        temperature=0.0, ignore_eos=True, timeout_s=cfg.timeout_s,
                        warmup=warmup)

    one = specs([(cfg.one_user_input, cfg.one_user_output)] * cfg.one_user_requests)
    conc = specs([(rng.randint(100, 500), rng.randint(50, 200)) for _ in range(cfg.concurrent)])
    long = specs([(cfg.long_prompt, cfg.long_output)])
    return Phases(one_user=plan(one, 1, warmup=1), concurrent=plan(conc, cfg.concurrent, 0),
                  long=plan(long, 1, 0))
