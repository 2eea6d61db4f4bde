"""Peer `llama-server`: the load of a LoadPlan sent to llama.cpp's server over its
OpenAI-compatible streaming completions endpoint (`POST /v1/completions`).

Each request sends the SAME prompt token ids as the other peers (`"prompt": [ids]`; the
OpenAI API allows a token array), `max_tokens`, `temperature` (0 = greedy), `ignore_eos`
(a llama.cpp extension of the body), `stream: true` and `cache_prompt: true` (llama.cpp's
prefix reuse, as Conveyor's prefix cache is on by default). The reply is server-sent
events, one `data: {json}` line per event, ended by `data: [DONE]`:

    data: {"choices": [{"text": " Paris", "finish_reason": null, ...}], ...}   one per token
    data: {"choices": [{"text": "", "finish_reason": "length"}], "usage": {...},
           "timings": {"prompt_ms", "predicted_per_token_ms", "cache_n", ...}}
    data: [DONE]

llama-server sends one chunk per sampled token (its text may be empty while a possible
stop string is held back), except a token that ends inside a UTF-8 character, whose
bytes ride in the next chunk. So each chunk before the last counts as one token, and
tokens that `usage.completion_tokens` reports beyond that count are booked at the last
chunk's time (`ChunkCounter`). Times are stamped as the client's line reader hands each
event over (`time.perf_counter()`, like the WebSocket runner), so TTFT / ITL / E2E mean
the same as for the other targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.request_spec import RequestSpec
from service.bench.runner import new_records

COMPLETIONS_PATH = "/v1/completions"
WARMUP_IDS = [504, 2093, 314]  # any three ids, as the transformers peers' warm-up


class ChunkCounter:
    """Turns the stream's events into a record's deltas, finish and usage, and checks them.

    Feed `event()` each decoded `data:` JSON object in order, with its arrival time
    (seconds from the run's start); then `problems()`.
    """

    def __init__(self, spec: RequestSpec, rec: RequestRecord, ignore_eos: bool) -> None:
        self.spec = spec
        self.rec = rec
        self.ignore_eos = ignore_eos
        self.final: dict | None = None

    def event(self, data: dict, now: float) -> None:
        """One event. Raises ValueError for an `error` event or a chunk without choices
        where one is due (the caller records it as the request's error)."""
        if "error" in data:
            err = data["error"]
            raise ValueError(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) > 1:
            raise ValueError(f"unexpected event {str(data)[:200]}")
        if not choices:  # a usage-only event (stream_options.include_usage)
            self._final(data, now)
            return
        if choices[0].get("finish_reason") is None:
            self.rec.delta_times_s.append(now)
            self.rec.delta_token_counts.append(1)
            return
        self.rec.finish_reason = choices[0]["finish_reason"]
        self._final(data, now)

    def _final(self, data: dict, now: float) -> None:
        self.final = data
        self.rec.done_s = now
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.rec.prompt_tokens = usage.get("prompt_tokens")
            self.rec.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.rec.cached_tokens = details.get("cached_tokens")
            missing = (self.rec.completion_tokens or 0) - self.rec.output_tokens
            if missing > 0:  # tokens that came without a chunk of their own (module doc)
                self.rec.delta_times_s.append(now)
                self.rec.delta_token_counts.append(missing)
        timings = data.get("timings")
        if isinstance(timings, dict) and timings.get("predicted_per_token_ms") is not None:
            self.rec.engine_tpot_ms = float(timings["predicted_per_token_ms"])

    def problems(self) -> list[str]:
        """What is wrong with the finished stream (empty when it is right)."""
        rec, spec = self.rec, self.spec
        if self.final is None:
            return ["the stream ended without a final chunk (finish_reason / usage)"]
        out = []
        if rec.completion_tokens is None:
            out.append("the final chunk has no usage.completion_tokens")
        elif rec.completion_tokens != rec.output_tokens:
            out.append(f"usage.completion_tokens {rec.completion_tokens} != "
                       f"{rec.output_tokens} token chunks received")
        if rec.prompt_tokens is not None and rec.prompt_tokens != spec.input_len:
            out.append(f"usage.prompt_tokens {rec.prompt_tokens} != {spec.input_len} sent")
        if self.ignore_eos:
            if rec.output_tokens != spec.max_tokens:
                out.append(f"{rec.output_tokens} tokens received under ignore_eos, "
                           f"max_tokens {spec.max_tokens}")
            if rec.finish_reason != "length":
                out.append(f"finish_reason {rec.finish_reason!r} under ignore_eos, "
                           "expected 'length'")
        elif rec.output_tokens > spec.max_tokens:
            out.append(f"{rec.output_tokens} tokens received, more than max_tokens "
                       f"{spec.max_tokens}")
        return out


def request_body(spec: RequestSpec, plan: LoadPlan) -> dict[str, object]:
    """The JSON body of `spec`'s completion request (module docstring)."""
    body: dict[str, object] = {"prompt": list(spec.prompt_token_ids),
                               "max_tokens": spec.max_tokens, "temperature": plan.temperature,
                               "ignore_eos": plan.ignore_eos, "stream": True,
                               "stream_options": {"include_usage": True},
                               "cache_prompt": True}
    if plan.temperature > 0:
        body["seed"] = plan.seed + spec.index
    return body


async def run_llama_server(base_url: str, plan: LoadPlan, *, progress: bool = True,
                           desc: str = "llama-server") -> list[RequestRecord]:
    """Run `plan` against the llama-server at `base_url` (http://HOST:PORT).

    One asyncio task per request: it sleeps until its arrival time, waits for a
    concurrency slot (plan.max_concurrency), then streams its completion. Returns one
    record per request in workload order; failures are recorded in `error`, never raised.
    Raises httpx.HTTPError when the server fails the warm-up (nothing was measured then).
    """
    import httpx
    from tqdm import tqdm

    records = new_records(plan)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(plan.timeout_s, connect=30.0)
    bar = tqdm(total=len(records), file=sys.stderr, disable=not progress, desc=desc,
               unit="req", dynamic_ncols=True)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits,
                                 timeout=timeout) as client:
        try:
            for _ in range(plan.warmup):
                resp = await client.post(COMPLETIONS_PATH, json={  # no workload prefix
                    "prompt": WARMUP_IDS, "max_tokens": 4, "temperature": 0.0,
                    "cache_prompt": False})
                resp.raise_for_status()
            sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
            t0 = time.perf_counter()
            await asyncio.gather(*(_one(client, spec, rec, plan, t0, sem, bar)
                                   for spec, rec in zip(plan.requests, records)))
        finally:
            bar.close()
    return records


async def _one(client, spec: RequestSpec, rec: RequestRecord, plan: LoadPlan, t0: float,
               sem: asyncio.Semaphore | None, bar) -> None:
    delay = t0 + rec.scheduled_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with sem if sem is not None else contextlib.nullcontext():
        rec.connection = 0
        try:
            rec.error = await _stream(client, spec, rec, plan, t0)
        finally:
            bar.update(1)


async def _stream(client, spec: RequestSpec, rec: RequestRecord, plan: LoadPlan,
                  t0: float) -> str | None:
    """Stream one completion into `rec`; returns its error text or None."""
    import httpx

    counter = ChunkCounter(spec, rec, plan.ignore_eos)
    rec.sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(plan.timeout_s):
            async with client.stream("POST", COMPLETIONS_PATH, json=request_body(spec, plan)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    return f"HTTP {resp.status_code}: {text[:300]}"
                async for line in resp.aiter_lines():
                    now = time.perf_counter() - t0
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    counter.event(json.loads(payload), now)
    except TimeoutError:
        return f"no final chunk within {plan.timeout_s:g} s (cancelled)"
    except (ValueError, httpx.HTTPError) as e:  # json.JSONDecodeError is a ValueError
        return f"{type(e).__name__}: {e}"
    return "; ".join(counter.problems()) or None
