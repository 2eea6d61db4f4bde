"""Peer `hf-continuous`: transformers' own continuous batching (the manager behind
`generate_batch`), transformers 5.x `generation/continuous_batching/`.

`generate_batch` takes every request at once; to give it the same arrival process as the
server, this drives the same manager directly: `model.init_continuous_batching(...)`,
`manager.start()` (its generation loop runs in its own thread), `add_request(...)` at
each request's send time (at most max_concurrency in flight), and `get_result()` until
every request is finished; then `stop()` and `destroy()`.

The manager schedules at most `max_num_seqs` requests and `max_num_batched_tokens`
tokens per step (`max_requests_per_batch`, `max_batch_tokens`), with its paged KV cache
sized for `max_num_seqs` of the workload's longest sequences. Token times are the
manager's own per-token timestamps (`record_timestamps=True`, perf_counter, the same
clock as ours): TTFT is when the first token was computed. `done_s` is when this thread
received the finished output. ignore_eos is `eos_token_id=-1` (no EOS).
"""

from __future__ import annotations

import math
import sys
import time

from tqdm import tqdm

from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.runner import new_records

PAGE_SIZE = 64  # tokens per KV page (transformers' default is 256, sized for GPUs)
WARMUP_IDS = [504, 2093, 314]


def run_hf_continuous(model, plan: LoadPlan, *, max_num_seqs: int, max_num_batched_tokens: int,
                      progress: bool = True) -> list[RequestRecord]:
    """Run `plan` through transformers' continuous batching manager (module docstring).

    Returns one record per request in workload order; `engine_queue_ms` is the time the
    manager held the request before scheduling it. Raises RuntimeError if the manager's
    generation thread dies.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(s.input_len + s.max_tokens for s in plan.requests)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=max_num_seqs * math.ceil(longest / PAGE_SIZE) + 1,
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
    )
    sampling: dict[str, object] = {"do_sample": False}
    if plan.temperature > 0:
        sampling = {"do_sample": True, "temperature": plan.temperature, "top_p": 1.0, "top_k": 0}
    gen_config = GenerationConfig(max_new_tokens=max(s.max_tokens for s in plan.requests),
                                  eos_token_id=model.generation_config.eos_token_id, **sampling)
    eos = -1 if plan.ignore_eos else None  # None: the generation config's EOS
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    manager.start()
    try:
        for k in range(plan.warmup):
            manager.add_request(WARMUP_IDS, request_id=f"warmup{k}", max_new_tokens=4,
                                eos_token_id=-1)
            while (r := manager.get_result(timeout=1.0)) is None or not r.is_finished():
                _alive(manager)
        return _drive(manager, plan, eos, progress)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()


def _alive(manager) -> None:
    if not manager.is_running():
        raise RuntimeError("transformers' continuous batching thread stopped unexpectedly")


def _drive(manager, plan: LoadPlan, eos: int | None, progress: bool) -> list[RequestRecord]:
    records = new_records(plan)
    n = len(records)
    cap = plan.max_concurrency or n
    in_flight: dict[str, int] = {}
    bar = tqdm(total=n, file=sys.stderr, disable=not progress, desc="hf-continuous",
               unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    nxt = finished = 0
    try:
        while finished < n:
            now = time.perf_counter() - t0
            while nxt < n and plan.arrivals[nxt] <= now and len(in_flight) < cap:
                spec = plan.requests[nxt]
                records[nxt].sent_s = time.perf_counter() - t0
                manager.add_request(list(spec.prompt_token_ids), request_id=spec.id,
                                    max_new_tokens=spec.max_tokens, record_timestamps=True,
                                    eos_token_id=eos)
                in_flight[spec.id] = nxt
                nxt += 1
            wait = plan.arrivals[nxt] - now if nxt < n and len(in_flight) < cap else 1.0
            result = manager.get_result(timeout=min(max(wait, 1e-3), 1.0))
            if result is None:
                _alive(manager)
                continue
            if not result.is_finished() or result.request_id not in in_flight:
                continue
            i = in_flight.pop(result.request_id)
            _fill(records[i], plan, result, t0, time.perf_counter() - t0)
            finished += 1
            bar.update(1)
    finally:
        bar.close()
    return records


def _fill(rec: RequestRecord, plan: LoadPlan, result, t0: float, received: float) -> None:
    spec = plan.requests[rec.index]
    tokens = list(result.generated_tokens)
    stamps = list(result.timestamps or [])
    rec.delta_times_s = [t - t0 for t in stamps]
    rec.delta_token_counts = [1] * len(stamps)
    rec.done_s = received
    rec.prompt_tokens = len(result.prompt_ids)
    rec.completion_tokens = len(tokens)
    rec.finish_reason = "length" if len(tokens) >= spec.max_tokens else "stop"
    start, _ = result.lifespan
    if start > 0:
        rec.engine_queue_ms = (start - result.created_time) * 1000.0
    problems = []
    if result.error is not None:
        problems.append(f"transformers: {result.error}")
    if len(stamps) != len(tokens):
        problems.append(f"{len(stamps)} timestamps for {len(tokens)} tokens")
    if rec.prompt_tokens != spec.input_len:
        problems.append(f"prompt of {rec.prompt_tokens} tokens, sent {spec.input_len}")
    if plan.ignore_eos and len(tokens) != spec.max_tokens:
        problems.append(f"{len(tokens)} tokens generated, max_tokens {spec.max_tokens}")
    rec.error = "; ".join(problems) or None
