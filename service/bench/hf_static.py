"""Peer `hf-static`: transformers' `generate` on left-padded static batches.

Static batching as servers did before continuous batching: when the model is idle, the
requests that have arrived (up to `max_num_seqs`, or `max_concurrency` if smaller) form
one batch, left-padded to its longest prompt, and generate until its longest completion
is done; requests arriving meanwhile wait for the next batch. A request completes when
its batch does (its `done_s` is the batch's end) even if its own max_tokens came earlier.

Token times come from a streamer hook on `generate` (`StepClock.put`, called once with
the prompt and then once per decoding step with the step's tokens [B]): request i's k-th
token is stamped with step k's time, so TTFT is when its first token was computed (the
prefill step), not when the batch finished.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from tqdm import tqdm

from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.request_spec import RequestSpec
from service.bench.runner import new_records

WARMUP_IDS = [504, 2093, 314]  # any three ids: a tiny untimed generate


class StepClock:
    """A `generate` streamer that only stamps the time of each decoding step.

    Attributes:
        times: perf_counter() - t0 of each step after the prompt, seconds.
    """

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt ids
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def run_hf_static(model, plan: LoadPlan, *, max_num_seqs: int, pad_token_id: int,
                  progress: bool = True) -> list[RequestRecord]:
    """Run `plan` through `model.generate` in static batches (see the module docstring).

    model: a transformers causal LM (eval mode). Greedy unless plan.temperature > 0.
    Returns one record per request in workload order; `engine_queue_ms` is the wait
    before its batch started.
    """
    records = new_records(plan)
    cap = min(max_num_seqs, plan.max_concurrency or max_num_seqs)
    for _ in range(plan.warmup):
        _generate(model, [WARMUP_IDS], 4, plan, pad_token_id, None)
    bar = tqdm(total=len(records), file=sys.stderr, disable=not progress, desc="hf-static",
               unit="req", dynamic_ncols=True)
    pending = collections.deque(range(len(records)))
    t0 = time.perf_counter()
    try:
        while pending:
            now = time.perf_counter() - t0
            due = plan.arrivals[pending[0]]
            if due > now:
                time.sleep(due - now)
                continue
            batch: list[int] = []
            while pending and len(batch) < cap and plan.arrivals[pending[0]] <= now:
                batch.append(pending.popleft())
            _run_batch(model, plan, records, batch, pad_token_id, t0)
            bar.update(len(batch))
    finally:
        bar.close()
    return records


def _run_batch(model, plan: LoadPlan, records: list[RequestRecord], batch: list[int],
               pad_token_id: int, t0: float) -> None:
    specs = [plan.requests[i] for i in batch]
    start = time.perf_counter() - t0
    for i in batch:
        records[i].sent_s = records[i].scheduled_s  # handed to the peer's queue on arrival
        records[i].engine_queue_ms = (start - records[i].sent_s) * 1000.0
    clock = StepClock(t0)
    try:
        out = _generate(model, [list(s.prompt_token_ids) for s in specs],
                        max(s.max_tokens for s in specs), plan, pad_token_id, clock)
    except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, the run goes on
        for i in batch:
            records[i].error = f"generate failed: {type(e).__name__}: {e}"
        return
    end = time.perf_counter() - t0
    for row, (i, spec) in enumerate(zip(batch, specs)):
        _fill(records[i], spec, out[row].tolist(), clock.times, end, model, plan)


def _fill(rec: RequestRecord, spec: RequestSpec, tokens: list[int], times: list[float],
          end: float, model, plan: LoadPlan) -> None:
    tokens = tokens[:spec.max_tokens]
    finish = "length"
    if not plan.ignore_eos:
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        stop = next((k for k, t in enumerate(tokens) if t in eos), None)
        if stop is not None:
            tokens, finish = tokens[:stop + 1], "stop"
    rec.delta_times_s = times[:len(tokens)]
    rec.delta_token_counts = [1] * len(rec.delta_times_s)
    rec.done_s = end
    rec.finish_reason = finish
    rec.prompt_tokens = spec.input_len
    rec.completion_tokens = len(tokens)
    if plan.ignore_eos and len(rec.delta_times_s) != spec.max_tokens:
        rec.error = f"{len(rec.delta_times_s)} tokens generated, max_tokens {spec.max_tokens}"


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], max_new_tokens: int, plan: LoadPlan,
              pad_token_id: int, clock: StepClock | None) -> torch.Tensor:
    """New tokens [B, max_new_tokens] of left-padded `prompts` (rows may end early in
    pad ids when EOS is allowed)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])     # [B, S]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])    # [B, S]
    sampling: dict[str, object] = {"do_sample": False}
    if plan.temperature > 0:
        torch.manual_seed(plan.seed)
        sampling = {"do_sample": True, "temperature": plan.temperature, "top_p": 1.0, "top_k": 0}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens if plan.ignore_eos else None,
                         pad_token_id=pad_token_id, streamer=clock, **sampling)
    return out[:, width:]                                                             # [B, N]
