"""The load generator: sends a LoadPlan to a Conveyor server over PROTOCOL.md and records
every frame's arrival time.

One asyncio task per request: it sleeps until its scheduled time, waits for a
concurrency slot, sends `generate` on its socket (request i on socket i % connections)
and stamps each Delta and the Done with `time.perf_counter()` as the client's reader
hands them over. Run it in its own process (the CLI does): sharing an event loop or the
GIL with the server would fold the server's work into the client's timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from tqdm import tqdm

from protocol import Client, ClientConnectionClosed, Delta, Done, ProtocolError, connect
from service.bench.checks import StreamCheck
from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.bench.request_spec import RequestSpec

WARMUP_PROMPT = "Warm-up request: reply with a short greeting."
WARMUP_TOKENS = 4


def new_records(plan: LoadPlan) -> list[RequestRecord]:
    """One empty record per request of `plan`, in workload order."""
    return [RequestRecord(index=s.index, request_id=s.id, input_tokens=s.input_len,
                          max_tokens=s.max_tokens, scheduled_s=t)
            for s, t in zip(plan.requests, plan.arrivals)]


async def run_server(url: str, plan: LoadPlan, *, progress: bool = True,
                     desc: str = "conveyor") -> list[RequestRecord]:
    """Run `plan` against the server at `url` (ws://HOST:PORT/v1/stream).

    Returns one record per request, in workload order; failures are recorded in
    `RequestRecord.error`, never raised. A progress bar goes to stderr unless
    `progress` is False.

    Raises OSError / ClientConnectionClosed / ProtocolError when the server cannot be
    reached or refuses the warm-up request (nothing was measured then).
    """
    clients: list[Client] = []
    bar = tqdm(total=len(plan.requests), file=sys.stderr, disable=not progress, desc=desc,
               unit="req", dynamic_ncols=True)
    try:
        for _ in range(plan.connections):
            clients.append(await connect(url))
        for _ in range(plan.warmup):
            await _warmup(clients[0])
        records = new_records(plan)
        sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _one(clients[i % len(clients)], i % len(clients), spec, rec, plan, t0, sem, bar)
            for i, (spec, rec) in enumerate(zip(plan.requests, records))))
        return records
    finally:
        bar.close()
        for client in clients:
            await client.close()


async def _warmup(client: Client) -> None:
    async for event in client.generate(prompt=WARMUP_PROMPT, max_tokens=WARMUP_TOKENS,
                                       temperature=0.0, ignore_eos=True):
        if isinstance(event, Done) and event.finish_reason == "error":
            raise RuntimeError("the server failed the warm-up request")


async def _one(client: Client, conn: int, spec: RequestSpec, rec: RequestRecord, plan: LoadPlan,
               t0: float, sem: asyncio.Semaphore | None, bar: tqdm) -> None:
    delay = t0 + rec.scheduled_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with sem if sem is not None else contextlib.nullcontext():
        rec.connection = conn
        try:
            await _stream(client, spec, rec, plan, t0)
        finally:
            bar.update(1)


async def _stream(client: Client, spec: RequestSpec, rec: RequestRecord, plan: LoadPlan,
                  t0: float) -> None:
    check = StreamCheck(spec, plan.ignore_eos)
    try:
        stream = client.generate(id=spec.id, **spec.wire(), **plan.params(spec))
    except ProtocolError as e:  # refused locally, before sending: the frame is invalid
        rec.error = f"{e.code}: {e.message}"
        return
    rec.sent_s = time.perf_counter() - t0  # the frame goes out on the first iteration
    problems: list[str] = []
    try:
        async with asyncio.timeout(plan.timeout_s):
            async for event in stream:
                now = time.perf_counter() - t0
                if isinstance(event, Delta):
                    rec.delta_times_s.append(now)
                    rec.delta_token_counts.append(len(event.token_ids))
                    check.delta(event)
                else:
                    rec.done_s = now
                    _fill_done(rec, event)
                    problems = check.done(event)
        if stream.error is not None:
            problems.insert(0, f"{stream.error.code}: {stream.error.message}")
    except TimeoutError:
        problems = [f"no done within {plan.timeout_s:g} s (cancelled)"]
    except ProtocolError as e:
        problems = [f"{e.code}: {e.message}"]
    except ClientConnectionClosed as e:
        problems = [f"connection closed: {e}"]
    finally:
        await stream.aclose()
    if rec.done_s is None and not problems:
        problems = ["the stream ended without a done"]
    rec.error = "; ".join(problems) or None


def _fill_done(rec: RequestRecord, done: Done) -> None:
    rec.finish_reason = done.finish_reason
    rec.prompt_tokens = done.usage.prompt_tokens
    rec.completion_tokens = done.usage.completion_tokens
    rec.cached_tokens = done.usage.cached_tokens
    t = done.timings
    rec.engine_queue_ms = t.queue_ms
    rec.engine_ttft_ms = t.ttft_ms
    rec.engine_tpot_ms = t.tpot_ms
    rec.engine_e2e_ms = t.e2e_ms
    rec.preemptions = t.preemptions
