"""Two engine replicas on Ray Serve behind one WebSocket endpoint, with the real model.

Through the real endpoint (Ray Serve's HTTP proxy -> ingress -> replicas): the
/v1/stream checks the single-process server passes, prefix-cache affinity, spreading
of unrelated prompts, greedy outputs equal to the single-process server's, and
failover. Tests run in file order on one cluster (one Ray start): the spreading test
comes first, while the router's table is empty; failover comes last.

Failover: one replica's actor is killed mid-stream (a crashed process, as Ray sees
it). Its requests end with `error` (internal_error, retryable) and then `done`
("error"), never a hang; the other replica's requests finish; new requests go to the
survivor; Ray Serve starts a replacement replica, which then takes requests too.
"""

from __future__ import annotations

import asyncio
import json

import websockets

from protocol import Delta, Done, connect
from service.config import ServerConfig
from tests.cluster.conftest import cluster_marks, small_engine_config
from tests.integration.greedy_prompts import GREEDY_PROMPTS
from tests.integration.stream_checks import (check_bad_frames, check_cancel_mid_stream,
                                             check_eight_requests_multiplexed,
                                             check_hello_health_and_paris, collect)

pytestmark = cluster_marks

# 259 tokens of system prompt (18 numbered rules), 280 with the chat template's turn.
SYSTEM = "You are the assistant of a ferry company. " + " ".join(
    f"Rule {i}: answer questions about ferry number {i} politely." for i in range(18))


async def ask(url: str, messages: list[dict[str, str]], max_tokens: int = 4) -> Done:
    async with await connect(url) as client:
        _, done = await collect(client.generate(messages=messages, max_tokens=max_tokens,
                                                temperature=0, ignore_eos=True))
    return done


async def test_different_prompts_spread_over_both_replicas(cluster):
    before = await cluster.routed()
    for i in range(8):
        content = f"Request number {i}: summarize this list. " + ", ".join(
            f"item {i}-{k}" for k in range(12))  # ~110 tokens: 2 of 7 blocks shared
        done = await ask(cluster.url, [{"role": "user", "content": content}])
        assert done.finish_reason == "length"
    got = await cluster.routed() - before
    assert sum(got.values()) == 8 and len(got) == 2, got
    assert min(got.values()) >= 2, got


async def test_shared_prefix_requests_land_on_one_replica_and_hit_the_cache(cluster):
    before = await cluster.routed()
    dones = []
    for i in range(8):
        dones.append(await ask(cluster.url, [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"When does ferry {i} leave on day {i + 3}?"}]))
    got = await cluster.routed() - before
    assert len(got) == 1 and sum(got.values()) == 8, got
    assert dones[0].usage.prompt_tokens >= 256 + 16
    cached = [d.usage.cached_tokens for d in dones]
    assert all(c >= 240 for c in cached[1:]), cached


async def test_hello_health_and_paris(cluster):
    await check_hello_health_and_paris(cluster.url, cluster.http + "/health")


async def test_eight_requests_multiplexed_get_exactly_max_tokens(cluster):
    await check_eight_requests_multiplexed(cluster.url)


async def test_cancel_mid_stream(cluster):
    await check_cancel_mid_stream(cluster.url)


async def test_bad_frames_get_invalid_request_and_socket_keeps_working(cluster):
    await check_bad_frames(cluster.url)


async def test_metrics_show_every_replica_and_the_router(cluster):
    status, text = await cluster.aget("/metrics")
    assert status == 200
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("conveyor:num_requests_running{")}
    assert len(replicas) == 2 and all(r.startswith("SERVE_REPLICA::") for r in replicas)
    assert 'conveyor:cluster_routing_decisions_total{reason="affinity"}' in text
    assert text.count("# TYPE conveyor:prefix_cache_hits_total counter") == 1
    status, body = await cluster.aget("/health")
    assert status == 200 and '"replicas":2' in body


async def test_greedy_outputs_equal_the_single_process_server(cluster, loaded_model):
    from service.engine import Engine
    from service.front.server import FrontServer

    async def run(url: str) -> list[tuple[str, list[int]]]:
        out = []
        async with await connect(url) as client:
            for prompt in GREEDY_PROMPTS:
                deltas, done = await collect(client.generate(prompt=prompt, max_tokens=32,
                                                             temperature=0))
                assert done.finish_reason in ("stop", "length")
                out.append(("".join(d.text for d in deltas),
                            [t for d in deltas for t in d.token_ids]))
        return out

    from_cluster = await run(cluster.url)
    async with Engine(small_engine_config(), loaded=loaded_model) as engine:
        server = await FrontServer(engine, ServerConfig(port=0)).start()
        try:
            single = await run(server.url)
        finally:
            await server.close()
    assert from_cluster == single
    assert all(len(ids) >= 8 for _, ids in single)


async def test_a_request_survives_its_socket_closing_elsewhere(cluster):
    """Closing one socket cancels its requests only: another socket's request finishes."""
    async with await connect(cluster.url) as keeper:
        kept = keeper.generate(prompt="Count: 1, 2, 3,", max_tokens=24, ignore_eos=True,
                               temperature=0)
        async with await connect(cluster.url) as leaver:
            gone = leaver.generate(prompt="Tell me a story.", max_tokens=400, ignore_eos=True)
            async for ev in gone:
                if isinstance(ev, Delta):
                    break
        deltas, done = await asyncio.wait_for(collect(kept), 120)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 24
    # the abandoned 400-token request was aborted at its replica: both go idle soon
    for _ in range(100):
        status, text = await cluster.aget("/metrics")
        running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("conveyor:num_requests_running{")]
        if len(running) == 2 and not any(running):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"replicas still running requests: {running}")


async def test_responses_chained_turns_stay_on_one_replica_and_hit_the_cache(cluster):
    """/v1/responses through the cluster: the same ResponsesConnection actor; a chained
    conversation's prompts share their prefix, so affinity keeps it on one replica."""
    from tests.integration.test_responses_ws import MODEL, blocks, check_stream, client, turn

    before = await cluster.routed()
    texts, usages, previous = [], [], None
    async with client(cluster).responses.connect() as conn:
        for q in ["What is the capital of France?", "And the capital of Italy?",
                  "And the capital of Spain?"]:
            events = await turn(conn, model=MODEL, input=q, temperature=0,
                                max_output_tokens=32, previous_response_id=previous)
            texts.append(check_stream(events))
            usages.append(events[-1].response.usage)
            previous = events[-1].response.id
    assert "Paris" in texts[0]
    got = await cluster.routed() - before
    assert len(got) == 1 and sum(got.values()) == 3, got
    for earlier, later in zip(usages, usages[1:]):
        context = earlier.input_tokens + earlier.output_tokens - 1
        assert later.input_tokens_details.cached_tokens >= blocks(context), (earlier, later)


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
