"""The engine-only benchmark's runs: scenarios, the synchronous step driver around
EngineCore, and per-run statistics (see `service.bench.engine_only`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from protocol import Delta, SamplingParams, encode
from service.config import CacheConfig, EngineConfig, SchedulerConfig
from service.core.engine_core import EngineCore
from service.core.request import Request
from service.engine.detokenizer import IncrementalDetokenizer
from service.worker.loader import LoadedModel
from service.worker.model_runner import ModelRunner
from service.worker.section_timer import SectionTimer

SECTIONS = ("schedule", "build_batch", "linear", "attention", "other", "fused", "sample",
            "update", "detokenize+stream")


@dataclass(frozen=True)
class Scenario:
    """kind "decode": num_seqs sequences decoding at about `context` tokens of context;
    kind "prefill": one prompt of `context` tokens prefilled per step."""

    kind: str
    num_seqs: int
    context: int

    @property
    def name(self) -> str:
        return f"decode-{self.num_seqs}" if self.kind == "decode" else f"prefill-{self.context}"


@dataclass
class RunStats:
    """Per-step wall times of one (variant, scenario) in one round, seconds."""

    tokens_per_step: int
    totals: list[float] = field(default_factory=list)
    sections: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SECTIONS})


class Workload:
    """An EngineCore over one runner's cache, real-text prompts, a detokenizer per request."""

    def __init__(self, runner: ModelRunner, tokens: list[int], max_num_seqs: int,
                 token_budget: int = 512) -> None:
        self.runner = runner
        self.tokens = tokens
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget)
        # The cache is sized for the scenario: no watermark may hold back or preempt anyone.
        cache = CacheConfig(block_size=runner.block_size, num_kv_blocks=runner.num_blocks,
                            enable_prefix_caching=False, kv_watermark_low=1.0,
                            kv_watermark_high=1.0, kv_watermark_critical=1.0)
        self.core = EngineCore(EngineConfig(cache=cache, scheduler=config), runner)
        self.sched = self.core.scheduler
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._next = 0

    def add(self, prompt_len: int, max_tokens: int) -> Request:
        # Each prompt is cut at a different offset of the text (no two share a prefix).
        start = (self._next * 997) % max(1, len(self.tokens) - prompt_len)
        ids = self.tokens[start:start + prompt_len]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = Request(f"bench-{self._next}", ids, params, self.runner.eos_token_ids)
        self._next += 1
        self.core.add_request(req)
        self.detoks[req.request_id] = IncrementalDetokenizer(self.runner.tokenizer, ids)
        return req

    def step(self, stats: RunStats | None) -> int:
        """One engine iteration (EngineCore.step) plus what the front does with its
        outputs; with stats, its sections are recorded. Returns the tokens it ran."""
        timer = self.runner.timer if stats is not None else None
        if timer is not None:
            timer.seconds = {}
        t0 = time.perf_counter()
        outputs = self.core.step()
        t3 = time.perf_counter()
        for out in outputs:  # what the front does per new token: text delta, one JSON frame
            detok = self.detoks[out.request_id]
            text = detok.step(out.new_token_ids).text
            encode(Delta(id=out.request_id, index=0, text=text, token_ids=out.new_token_ids))
            if out.finish_reason is not None:
                del self.detoks[out.request_id]
        t4 = time.perf_counter()
        if stats is not None and timer is not None:
            sec = stats.sections
            times = self.core.last_step_times
            sec["schedule"].append(times.schedule)
            for name in ("build_batch", "linear", "attention", "other", "fused", "sample"):
                sec[name].append(timer.seconds.get(name, 0.0))
            sec["update"].append(times.update)
            sec["detokenize+stream"].append(t4 - t3)
            stats.totals.append(t4 - t0)
        return self.core.last_num_batched_tokens

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Within the block the runner carries a SectionTimer (its model instrumented once
        for the whole measurement, not per step); `step(stats)` reads it."""
        self.runner.timer = SectionTimer(self.runner.device)
        try:
            yield
        finally:
            self.runner.timer = None

    def finish_all(self) -> None:
        for rid in list(self.sched.requests):
            self.core.abort(rid)
        self.detoks.clear()
        self.core.check_integrity()


class DecodeRun:
    """decode-N: N sequences prefilled once, then measured `steps` at a time."""

    def __init__(self, runner: ModelRunner, tokens: list[int], sc: Scenario, steps: int,
                 rounds: int, warmup: int) -> None:
        self.wl = Workload(runner, tokens, sc.num_seqs)
        total = warmup + steps * rounds
        # prompts end total/2 tokens before `context`: the measured contexts centre on it
        prompt_len = max(1, sc.context - total // 2)
        # Early sequences decode while later prompts are still prefilled in chunks of 512
        # tokens: give them room for those steps too.
        max_tokens = total + 8 + (sc.num_seqs * prompt_len) // 256
        self.reqs = [self.wl.add(prompt_len, max_tokens) for _ in range(sc.num_seqs)]
        while any(not r.output_token_ids for r in self.reqs):  # prefill, untimed
            self.wl.step(None)
        for _ in range(warmup):
            self.wl.step(None)
        self.num_seqs = sc.num_seqs

    def measure(self, steps: int) -> RunStats:
        stats = RunStats(self.num_seqs)
        with self.wl.timed():
            for _ in range(steps):
                scheduled = self.wl.step(stats)
                if scheduled != self.num_seqs or self.wl.sched.num_preemptions:
                    raise RuntimeError(f"decode step ran {scheduled} of {self.num_seqs} "
                                       f"sequences ({self.wl.sched.num_preemptions} preemptions)")
        return stats

    def close(self) -> None:
        self.wl.finish_all()


class PrefillRun:
    """prefill-P: every measured step is the whole prefill of a fresh P-token prompt."""

    def __init__(self, runner: ModelRunner, tokens: list[int], sc: Scenario, warmup: int) -> None:
        self.wl = Workload(runner, tokens, 1, token_budget=max(512, sc.context))
        self.context = sc.context
        for _ in range(warmup):
            self.wl.add(self.context, 1)
            self.wl.step(None)

    def measure(self, steps: int) -> RunStats:
        stats = RunStats(self.context)
        with self.wl.timed():
            for _ in range(steps):
                self.wl.add(self.context, 1)
                if self.wl.step(stats) != self.context or self.wl.sched.has_unfinished():
                    raise RuntimeError("a prefill step did not run the whole prompt")
        return stats

    def close(self) -> None:
        self.wl.finish_all()


def summarize(runs: list[RunStats]) -> dict[str, object]:
    """Median over runs of each run's median step; sections as means over all steps (ms)."""
    medians = [statistics.median(r.totals) for r in runs]
    step_s = statistics.median(medians)
    steps = [t for r in runs for t in r.totals]
    sections = {s: 1e3 * statistics.fmean(v for r in runs for v in r.sections[s]) for s in SECTIONS}
    return {
        "tokens_per_s": runs[0].tokens_per_step / step_s,
        "steps_per_s": 1.0 / step_s,
        "ms_per_step_median": 1e3 * step_s,
        "ms_per_step_mean": 1e3 * statistics.fmean(steps),
        "ms_per_step_run_medians": [round(1e3 * m, 2) for m in medians],
        "sections_ms_mean": sections,
        "steps_measured": len(steps),
    }


def text_tokens(loaded: LoadedModel, needed: int) -> list[int]:
    from service.bench.texts import PASSAGES

    ids = loaded.tokenizer.encode("\n\n".join(PASSAGES), add_special_tokens=False)
    while len(ids) < needed:
        ids = ids + ids
    return ids
