"""A reader that stops reading while 8 others stream (issue 8, item 2).

Each run streams the same greedy workload: 8 fast clients with one request each, and
one "slow" client (a socket with tiny kernel buffers) with 8 requests. In a stalled run
the slow client stops reading after its first delta, until the server's outbox for it
has merged deltas (so the backlog really reached the outbox) and at least STALL_S
seconds passed; in a baseline run it reads all the time. Runs alternate, baseline
first, PAIRS times.

Checked: the slow client's joined text and token ids equal the baseline's (nothing
lost by merging) and it got fewer delta frames than tokens (merging happened); the fast
clients' ITL p99 (gaps between their delta arrivals) in a stalled run stays within 2x
of the baseline run next to it, judged on the median ratio over the pairs, so that one
noisy run on this shared machine does not decide (with 2 pairs: their mean).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from service.config import ServerConfig

from tests.integration.reliability_support import (RawClient, generate_frame,
                                                   small_window_connect, wait_idle, wait_until)

pytestmark = [pytest.mark.model, pytest.mark.slow]

FAST, SLOW_REQUESTS, MAX_TOKENS = 8, 8, 32
STALL_S = 2.0
# Baseline / stalled pairs; the median ratio is checked. Three, so that one pair disturbed by
# the shared host does not decide it: with two, the median is the mean, and one pair at 3.7x
# (p99 190 ms against 51, the other pair 1.18x) failed a CI run on 2026-12-04.
PAIRS = 3


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


async def _run(server, stall: bool) -> tuple[float, dict[str, tuple[str, list[int]]], int, int]:
    """One run: (fast clients' ITL p99 in s, the slow client's text and ids per request,
    its delta frames, deltas merged in its outbox)."""
    fast = [await RawClient.connect(server.url) for _ in range(FAST)]
    slow = await small_window_connect(server.url, server.port, rcvbuf=1024)
    assert json.loads(await slow.recv())["type"] == "hello"
    slow_ids = {f"s{i}" for i in range(SLOW_REQUESTS)}
    for i in range(SLOW_REQUESTS):
        await slow.send(generate_frame(f"s{i}", prompt=f"Write a poem about river {i}.",
                                       max_tokens=MAX_TOKENS, ignore_eos=True))
    await wait_until(lambda: any(c.in_flight == slow_ids for c in server.connections), 60,
                     "the slow client's requests")
    conn = next(c for c in server.connections if c.in_flight == slow_ids)
    for i, client in enumerate(fast):
        await client.ws.send(generate_frame("f", prompt=f"List facts about planet {i}.",
                                            max_tokens=MAX_TOKENS, ignore_eos=True))
    got: dict[str, list[dict]] = {rid: [] for rid in slow_ids}
    done: set[str] = set()
    stalled = not stall

    while len(done) < SLOW_REQUESTS:
        msg = json.loads(await slow.recv())
        got[msg["id"]].append(msg)
        done |= {msg["id"]} if msg["type"] == "done" else set()
        if not stalled and msg["type"] == "delta":
            stalled = True  # stop reading, until the backlog has merged in the outbox
            t0 = time.monotonic()
            await wait_until(lambda: (time.monotonic() - t0 >= STALL_S and
                                      conn.outbox.merged_deltas > 0) or not conn.in_flight,
                             600, "the slow reader's stall")
    merged = conn.outbox.merged_deltas
    await slow.close()
    itls: list[float] = []
    for client in fast:
        frames = await client.wait_ended("f", 600)
        assert frames[-1]["finish_reason"] == "length"
        arrivals = [f["_at"] for f in frames if f["type"] == "delta"]
        itls += [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert len(client.text("f")[1]) == MAX_TOKENS
        await client.close()
    texts = {}
    for rid, frames in got.items():
        deltas = [f for f in frames if f["type"] == "delta"]
        assert frames[-1]["finish_reason"] == "length" and frames[0]["type"] == "accepted"
        texts[rid] = ("".join(d["text"] for d in deltas),
                      [t for d in deltas for t in d["token_ids"]])
    n_frames = sum(1 for frames in got.values() for f in frames if f["type"] == "delta")
    return _p99(itls), texts, n_frames, merged


async def test_slow_reader_stalls_nobody_else_and_gets_everything(make_server):
    engine, server = await make_server(
        # small kernel buffers, so the backlog reaches the outbox within ~10 KB; no
        # keepalive, which would drop a reader that stalls longer than 40 s on a busy machine
        ServerConfig(port=0, socket_send_buffer_bytes=1024, write_limit_bytes=1024,
                     ping_interval=600),
        max_num_seqs=FAST + SLOW_REQUESTS)
    ratios: list[float] = []
    reference = None
    for _ in range(PAIRS):
        base_p99, base_texts, base_frames, _ = await _run(server, stall=False)
        slow_p99, slow_texts, slow_frames, merged = await _run(server, stall=True)
        print(f"ITL p99: baseline {base_p99 * 1000:.1f} ms, with a stalled reader "
              f"{slow_p99 * 1000:.1f} ms; slow reader: {slow_frames} delta frames for "
              f"{SLOW_REQUESTS * MAX_TOKENS} tokens ({merged} merges)")
        reference = reference or base_texts
        assert base_texts == reference and slow_texts == reference  # nothing lost
        assert all(len(ids) == MAX_TOKENS for _, ids in slow_texts.values())
        assert merged > 0 and slow_frames < SLOW_REQUESTS * MAX_TOKENS  # the outbox merged
        ratios.append(slow_p99 / base_p99)
    assert statistics.median(ratios) <= 2.0, f"ITL p99 ratios (stalled / baseline): {ratios}"
    await wait_idle(engine)
