"""Failover: one replica's actor is killed mid-stream (a crashed process, as Ray sees it).

Its requests end with `error` (internal_error, retryable) and then `done` ("error"),
never a hang; the other replica's requests finish; new requests go to the survivor;
Ray Serve starts a replacement replica, which then takes requests too.
"""

from __future__ import annotations

import asyncio
import json

import websockets

from protocol import connect
from tests.cluster.conftest import cluster_marks
from tests.integration.stream_checks import collect

pytestmark = cluster_marks


async def replica_ids(cluster) -> set[str]:
    status, text = await cluster.aget("/metrics")
    return {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("conveyor:num_requests_running{")}


async def short_request(cluster, i: int):
    async with await connect(cluster.url) as client:
        _, done = await collect(client.generate(
            messages=[{"role": "user", "content": f"After the failure, question {i}: what "
                                                  f"is {i} plus {i}? Answer in a sentence."}],
            max_tokens=4, ignore_eos=True, temperature=0))
    return done


async def test_killing_a_replica_mid_stream(cluster):
    import ray

    before = await cluster.routed()
    ids = [f"f{i}" for i in range(4)]
    frames: dict[str, list[dict]] = {i: [] for i in ids}
    async with websockets.connect(cluster.url) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        for i, rid in enumerate(ids):
            await ws.send(json.dumps({
                "type": "generate", "id": rid,
                "prompt": f"Story {i}: once upon a time there was a ferry called {i * 7}.",
                "params": {"max_tokens": 300, "ignore_eos": True, "temperature": 0}}))

        async def read_until(cond) -> None:
            while not cond():
                msg = json.loads(await ws.recv())
                frames[msg["id"]].append(msg)

        def deltas(rid: str) -> int:
            return sum(m["type"] == "delta" for m in frames[rid])

        await asyncio.wait_for(read_until(lambda: all(deltas(r) >= 2 for r in ids)), 180)
        routed = await cluster.routed() - before
        assert sum(routed.values()) == 4 and len(routed) == 2, routed  # both replicas busy
        victim = min(routed)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

        def all_done() -> bool:
            return all(frames[r] and frames[r][-1]["type"] == "done" for r in ids)

        await asyncio.wait_for(read_until(all_done), 180)  # never a hang

    reasons = {r: frames[r][-1]["finish_reason"] for r in ids}
    failed = [r for r in ids if reasons[r] == "error"]
    assert len(failed) == routed[victim], (reasons, routed)
    for r in failed:
        error = frames[r][-2]
        assert error["type"] == "error" and error["code"] == "internal_error", error
        assert error["retryable"] is True and error["id"] == r
        done = frames[r][-1]
        assert done["usage"]["completion_tokens"] == sum(
            len(m["token_ids"]) for m in frames[r] if m["type"] == "delta")
    assert all(reasons[r] == "length" for r in ids if r not in failed), reasons

    # later requests: served by the survivor (the replacement takes ~a minute to load)
    survivor = next(rid for rid in routed if rid != victim)
    before = await cluster.routed()
    for i in range(3):
        assert (await short_request(cluster, i)).finish_reason == "length"
    got = await cluster.routed() - before
    assert victim not in got and sum(got.values()) == 3, got

    # Ray Serve replaces the dead replica; the replacement serves new prefixes
    for _ in range(300):
        now = await replica_ids(cluster)
        if len(now) == 2 and victim not in now:
            break
        await asyncio.sleep(1)
    else:
        raise AssertionError(f"no replacement replica: {now}")
    replacement = (now - {survivor}).pop()
    before = await cluster.routed()
    for i in range(3, 7):
        assert (await short_request(cluster, i)).finish_reason == "length"
    got = await cluster.routed() - before
    assert got[replacement] >= 1, got
