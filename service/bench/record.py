"""What was observed of one request: when it was sent, when each delta and the done came.

Times `*_s` are seconds from the start of the run on the measuring side's
`time.perf_counter()` (the benchmark client for a server; the worker thread for an
in-process peer). Latencies derived from them (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`)
are in milliseconds:

    TTFT = first delta - sent            E2E = done - sent
    TPOT = (last delta - first delta) / (output tokens - 1)     (None for 1 token)
    ITL  = gaps between consecutive deltas (a delta the server merged from several
           tokens counts once, as in vLLM's serving benchmark)

`engine_*` timings are the engine's own: Conveyor's `done.timings` (from its receipt of
the request), or the peer's in-process clocks for `engine_queue_ms` (time before its
first forward) with the other engine timings left None (the peer has no separate clock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """One request of a run; `error` None and `done_s` set means it completed and passed
    every check (`checks.StreamCheck`)."""

    index: int
    request_id: str
    input_tokens: int
    max_tokens: int
    scheduled_s: float
    connection: int | None = None
    sent_s: float | None = None
    done_s: float | None = None
    delta_times_s: list[float] = field(default_factory=list)
    delta_token_counts: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    engine_queue_ms: float | None = None
    engine_ttft_ms: float | None = None
    engine_tpot_ms: float | None = None
    engine_e2e_ms: float | None = None
    preemptions: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def output_tokens(self) -> int:
        return sum(self.delta_token_counts)

    @property
    def first_token_s(self) -> float | None:
        return self.delta_times_s[0] if self.delta_times_s else None

    @property
    def last_token_s(self) -> float | None:
        return self.delta_times_s[-1] if self.delta_times_s else None

    @property
    def ttft_ms(self) -> float | None:
        if self.sent_s is None or not self.delta_times_s:
            return None
        return (self.delta_times_s[0] - self.sent_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        n = self.output_tokens
        if n < 2:
            return None
        return (self.delta_times_s[-1] - self.delta_times_s[0]) * 1000.0 / (n - 1)

    @property
    def e2e_ms(self) -> float | None:
        if self.sent_s is None or self.done_s is None:
            return None
        return (self.done_s - self.sent_s) * 1000.0

    @property
    def itl_ms(self) -> list[float]:
        t = self.delta_times_s
        return [(b - a) * 1000.0 for a, b in zip(t, t[1:])]

    @property
    def ttft_gap_ms(self) -> float | None:
        """Client TTFT minus the engine's own TTFT: transport, framing and client delays."""
        if self.ttft_ms is None or self.engine_ttft_ms is None:
            return None
        return self.ttft_ms - self.engine_ttft_ms

    def to_json(self) -> dict[str, object]:
        """The stored fields plus ok, output_tokens, ttft_ms, tpot_ms, e2e_ms, ttft_gap_ms."""
        out = asdict(self)
        out.update(ok=self.ok, output_tokens=self.output_tokens, ttft_ms=self.ttft_ms,
                   tpot_ms=self.tpot_ms, e2e_ms=self.e2e_ms, ttft_gap_ms=self.ttft_gap_ms)
        return out
