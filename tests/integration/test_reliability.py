"""Reliability and security of the real server (real model, port 0): every limit's answer,
abrupt disconnects, slow readers, engine faults, in-process graceful shutdown, API key,
Origin checks and key redaction in the logs (issue 8)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import structlog
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from protocol import ClientConnectionClosed, Unauthorized, connect
from service.config import ServerConfig

from tests.integration.reliability_support import (RawClient, StepRecorder, generate_frame,
                                                   http_get, small_window_connect, wait_idle,
                                                   wait_until)

pytestmark = pytest.mark.model


def _config(**kw) -> ServerConfig:
    return ServerConfig(port=0, **kw)


# ---- limits -------------------------------------------------------------------------

async def test_oversized_frame_closes_the_socket_with_1009(make_server):
    engine, server = await make_server(_config(max_message_bytes=4096))
    async with websockets.connect(server.url, max_size=None) as ws:
        json.loads(await ws.recv())  # hello
        await ws.send(generate_frame("fits", prompt="x" * 3000, max_tokens=1))
        assert json.loads(await ws.recv())["type"] == "accepted"
        await ws.send(generate_frame("big", prompt="x" * 5000, max_tokens=1))
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await ws.recv()
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    await wait_idle(engine)


async def test_connection_over_the_limit_is_closed_with_1013(make_server):
    engine, server = await make_server(_config(max_connections=2))
    a, b = await connect(server.url), await connect(server.url)
    with pytest.raises(ClientConnectionClosed) as info:
        await connect(server.url)
    assert info.value.close_code == 1013 and "too many connections" in info.value.reason
    assert server.refused_connections == 1
    await a.close()
    await wait_until(lambda: len(server.connections) == 1, 30, "the closed slot to free")
    c = await connect(server.url)  # the freed slot is usable again
    assert c.hello.model == engine.model_name
    await b.close()
    await c.close()


async def test_requests_per_connection_cap_answers_too_many_requests(make_server):
    engine, server = await make_server(_config(max_requests_per_connection=2))
    client = await RawClient.connect(server.url)
    for rid in ("r1", "r2", "r3"):
        await client.ws.send(generate_frame(rid, max_tokens=400, ignore_eos=True))
    frames = await client.wait_ended("r3", 60)
    assert [f["type"] for f in frames] == ["error"]
    assert frames[0]["code"] == "too_many_requests" and frames[0]["retryable"] is False
    await client.ws.send(json.dumps({"type": "cancel", "id": "r1"}))
    await client.wait_ended("r1")
    await client.ws.send(generate_frame("r4", max_tokens=2))  # a slot is free again
    await client.wait_ended("r4")
    assert client.kinds("r4")[0] == "accepted" and client.kinds("r4")[-1] == "done"
    await client.close()
    await wait_idle(engine)


async def test_full_admission_queue_answers_overloaded_with_retry_after(make_server):
    engine, server = await make_server(max_num_seqs=1, max_waiting_requests=2)
    client = await RawClient.connect(server.url)
    await client.ws.send(generate_frame("first", max_tokens=300, ignore_eos=True))
    await wait_until(lambda: "delta" in client.kinds("first"), 60, "the first request to run")
    for i in range(5):
        await client.ws.send(generate_frame(f"q{i}", max_tokens=300, ignore_eos=True))
    await wait_until(lambda: all(client.frames.get(f"q{i}") for i in range(5)), 60,
                     "answers to the queued requests")
    answers = [client.frames[f"q{i}"][0] for i in range(5)]
    overloaded = [a for a in answers if a["type"] == "error"]
    assert [a["type"] for a in answers].count("accepted") == 2, answers
    assert len(overloaded) == 3
    for a in overloaded:
        assert a["code"] == "overloaded" and a["retryable"] is True and a["retry_after_ms"] >= 100
    await client.close()  # cancels the accepted ones
    await wait_idle(engine)


async def test_prompt_and_output_length_limits(make_server):
    engine, server = await make_server()
    client = await RawClient.connect(server.url)
    await client.ws.send(json.dumps({"type": "generate", "id": "long-prompt",
                                     "prompt_token_ids": [42] * 8192, "params": {}}))
    await client.ws.send(generate_frame("long-output", max_tokens=8192))
    await client.ws.send(generate_frame("zero", max_tokens=0))
    for rid, code in [("long-prompt", "context_length_exceeded"),
                      ("long-output", "context_length_exceeded"), ("zero", "invalid_request")]:
        frames = await client.wait_ended(rid, 60)
        assert len(frames) == 1 and frames[0]["code"] == code, frames
    await client.close()


# ---- disconnects ----------------------------------------------------------------------

async def test_abrupt_disconnect_frees_blocks_within_one_step(make_server):
    engine, server = await make_server()
    steps = StepRecorder(engine)
    keeper = await RawClient.connect(server.url)
    await keeper.ws.send(generate_frame("keep", max_tokens=300, ignore_eos=True))
    victim = await RawClient.connect(server.url)
    for i in range(3):
        await victim.ws.send(generate_frame(f"v{i}", prompt=f"Story number {i}:" * 20,
                                            max_tokens=400, ignore_eos=True))
    await wait_until(lambda: all(len(victim.frames[f"v{i}"]) > 3 for i in range(3)), 120,
                     "the victim's requests to stream")
    conn = next(c for c in server.connections if c.in_flight == {"v0", "v1", "v2"})
    victim_ids = {f"{conn.conn_id}/v{i}" for i in range(3)}
    aborted_at: list[int] = []
    original_abort = engine.abort

    def abort(request_id: str) -> None:
        if request_id in victim_ids:
            aborted_at.append(engine.num_steps)
        original_abort(request_id)

    engine.abort = abort  # type: ignore[method-assign]
    usage_before = engine.scheduler.pool.usage
    victim.abort()  # no close frame: the TCP connection just goes away
    await wait_until(lambda: len(aborted_at) == 3, 30, "the server to see the disconnect")
    await wait_until(lambda: not conn.in_flight, 30, "the victim's dones")
    s0 = max(aborted_at)
    # a step recorded with a count above s0 was scheduled after the aborts were applied
    await wait_until(lambda: any(n > s0 for n, _, _ in steps.steps), 60,
                     "the keeper's request to keep the engine stepping")
    later = [(n, held, ran) for n, held, ran in steps.steps if n > s0]
    for n, held, ran in later:
        assert not (held & victim_ids), f"step {n} still held a gone client's request"
    assert engine.scheduler.pool.usage < usage_before
    engine.scheduler.check_integrity()
    frames = await keeper.wait_ended("keep")
    assert frames[-1]["finish_reason"] == "length"  # the other client went on untouched
    await keeper.close()
    await wait_idle(engine)
    assert engine.scheduler.pool.usage == 0.0


async def test_request_still_queued_for_a_gone_client_never_runs(make_server):
    engine, server = await make_server(max_num_seqs=1)
    steps = StepRecorder(engine)
    keeper = await RawClient.connect(server.url)
    await keeper.ws.send(generate_frame("keep", max_tokens=60, ignore_eos=True))
    await wait_until(lambda: "delta" in keeper.kinds("keep"), 60, "the keeper to run")
    victim = await RawClient.connect(server.url)
    await victim.ws.send(generate_frame("queued", max_tokens=50))
    await wait_until(lambda: victim.kinds("queued") == ["accepted"], 30, "accepted")
    victim.abort()
    await keeper.wait_ended("keep")
    await wait_idle(engine)
    ran = set().union(*(r for _, _, r in steps.steps))
    assert any(k.endswith("/keep") for k in ran)
    assert not any(k.endswith("/queued") for k in ran), "a gone client's request ran"
    await keeper.close()


async def test_reader_past_the_outbox_limit_is_closed_1008_and_cancelled(make_server):
    # small kernel buffers on both ends, so the backlog reaches the outbox within a few KB;
    # 16 requests so that it does so within a few steps on a slow machine
    engine, server = await make_server(
        _config(max_outbox_bytes=2048, write_limit_bytes=1024, socket_send_buffer_bytes=4096,
                close_timeout=120, ping_interval=600), max_num_seqs=17)
    slow = await small_window_connect(server.url, server.port, rcvbuf=2048)
    for i in range(16):
        await slow.send(generate_frame(f"s{i}", max_tokens=2000, ignore_eos=True))
    # held: the front drops a connection from server.connections once its close is sent
    await wait_until(lambda: server.connections, 30, "the connection")
    conn = next(iter(server.connections))
    other = await RawClient.connect(server.url)  # a reader that keeps up is not affected
    await other.ws.send(generate_frame("fine", max_tokens=24, ignore_eos=True))
    await wait_until(lambda: conn.outbox.overflowed and not conn.in_flight, 300,
                     "the slow reader's outbox to overflow")
    codes = []
    try:
        while True:  # read again: what was buffered, then the close frame
            await slow.recv()
    except ConnectionClosed as exc:
        codes.append(exc.rcvd.code if exc.rcvd else 1006)
    assert codes == [1008]
    assert "too slow" in slow.close_reason
    frames = await other.wait_ended("fine")
    assert frames[-1]["finish_reason"] == "length"
    assert len(other.text("fine")[1]) == 24
    await other.close()
    await wait_idle(engine)
    assert engine.scheduler.pool.usage == 0.0


async def test_a_reader_that_never_reads_again_is_dropped_after_close_timeout(make_server):
    # the backlog fills every buffer, so even the 1008 close frame cannot be sent: the TCP
    # connection is dropped close_timeout later (no close frame reaches the client)
    engine, server = await make_server(
        _config(max_outbox_bytes=2048, write_limit_bytes=1024, socket_send_buffer_bytes=4096,
                close_timeout=2, ping_interval=600), max_num_seqs=17)
    slow = await small_window_connect(server.url, server.port, rcvbuf=2048)
    for i in range(16):
        await slow.send(generate_frame(f"s{i}", max_tokens=2000, ignore_eos=True))
    await wait_until(lambda: server.connections, 30, "the connection")
    conn = next(iter(server.connections))
    await wait_until(lambda: conn.outbox.overflowed, 300, "the slow reader's outbox to overflow")
    await wait_until(lambda: conn not in server.connections, 30,
                     "the connection to be dropped after close_timeout")
    with pytest.raises(ConnectionClosed) as info:
        while True:  # what was buffered, then the end of the TCP stream
            await slow.recv()
    assert info.value.rcvd is None, info.value  # dropped, never closed with a frame
    await wait_idle(engine)
    assert engine.scheduler.pool.usage == 0.0


# ---- engine faults ------------------------------------------------------------------------

async def test_injected_step_fault_fails_only_the_request_it_belongs_to(make_server):
    engine, server = await make_server(max_num_seqs=1)
    client = await RawClient.connect(server.url)
    await client.ws.send(generate_frame("hit", max_tokens=300, ignore_eos=True))
    await wait_until(lambda: "delta" in client.kinds("hit"), 60, "the first request to run")
    await client.ws.send(generate_frame("waiting", max_tokens=6, ignore_eos=True))
    await wait_until(lambda: client.kinds("waiting") == ["accepted"], 30, "accepted")
    with structlog.testing.capture_logs() as logs:
        engine.inject_fault("execute", request_id="hit", count=None)  # every forward with it
        hit = await client.wait_ended("hit")
        waiting = await client.wait_ended("waiting")
    assert [f["type"] for f in hit[-2:]] == ["error", "done"]
    assert hit[-2]["code"] == "internal_error" and hit[-2]["id"] == "hit"
    assert hit[-1]["finish_reason"] == "error"
    assert waiting[-1]["finish_reason"] == "length"  # not its fault: unharmed
    assert len(client.text("waiting")[1]) == 6
    failed = [e for e in logs if e["event"] == "request_failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == "hit"
    assert "injected execute fault" in failed[0]["error"]
    assert engine.health() == (True, "ok")
    await client.ws.send(generate_frame("after", max_tokens=5, ignore_eos=True))
    after = await client.wait_ended("after")  # the engine keeps serving
    assert after[-1]["finish_reason"] == "length"
    await client.close()
    await wait_idle(engine)


@pytest.mark.parametrize("hostile", [{"top_k": 2 ** 31 - 1}, {"top_p": 1e-300}])
async def test_hostile_sampling_values_cannot_fail_other_requests(make_server, hostile):
    engine, server = await make_server()
    client = await RawClient.connect(server.url)
    await client.ws.send(generate_frame("victim", max_tokens=12, ignore_eos=True))
    await wait_until(lambda: "delta" in client.kinds("victim"), 60, "the victim to run")
    await client.ws.send(generate_frame("hostile", max_tokens=4, temperature=1.0, **hostile))
    victim = await client.wait_ended("victim")
    await client.wait_ended("hostile")
    await client.close()
    await wait_idle(engine)
    assert victim[-1]["finish_reason"] == "length", client.kinds("victim")


# ---- shutdown (in process; the real SIGTERM path is test_reliability_shutdown.py) ------

async def test_shutdown_drains_then_cancels_and_closes_with_1001(make_server):
    engine, server = await make_server(_config(close_timeout=10))
    client = await RawClient.connect(server.url)
    await client.ws.send(generate_frame("long", max_tokens=4000, ignore_eos=True))
    await client.ws.send(generate_frame("short", max_tokens=3, ignore_eos=True))
    await wait_until(lambda: "delta" in client.kinds("long"), 60, "streaming")
    force = asyncio.Event()  # stands for the timeout expiring (a second signal in the CLI)
    drain = asyncio.create_task(server.shutdown(timeout=600, force=force))
    await wait_until(lambda: not engine.accepting, 10, "the drain to start")
    assert (await http_get(server.port, "/health"))[0] == 503
    await client.ws.send(generate_frame("late", max_tokens=3))
    late = await client.wait_ended("late")
    assert late[0]["code"] == "shutting_down" and late[0]["retryable"] is True
    short = await client.wait_ended("short")  # in flight: it may finish
    assert short[-1]["finish_reason"] == "length"
    assert not drain.done() and not client.closed
    force.set()
    assert await drain is False  # "long" had to be cancelled
    assert client.frames["long"][-1]["finish_reason"] == "cancelled"
    await wait_until(lambda: client.closed, 10, "the socket to close")
    assert client.close_code == 1001
    await wait_idle(engine)


# ---- security -------------------------------------------------------------------------

KEY = "k-test_Key.42"


async def test_api_key_and_origin_checks_before_the_upgrade(make_server):
    engine, server = await make_server(_config(api_key=KEY,
                                               allowed_origins=("http://good.example:1",)))
    port, auth = server.port, {"Authorization": f"Bearer {KEY}"}
    assert (await http_get(port, "/health"))[0] == 200  # open for load balancers
    status, hdrs, _ = await http_get(port, "/metrics")
    assert status == 401 and hdrs["www-authenticate"].startswith("Bearer")
    assert (await http_get(port, "/metrics", auth))[0] == 200
    assert (await http_get(port, f"/metrics?api_key={KEY}"))[0] == 200
    assert (await http_get(port, "/"))[0] == 401
    status, hdrs, body = await http_get(port, f"/?api_key={KEY}")  # the chat page's own URL
    assert status == 200 and "text/html" in hdrs["content-type"] and "<html" in body.lower()
    assert (await http_get(port, "/", {"Authorization": "Bearer wrong"}))[0] == 401
    # WebSocket handshake
    for kw in [{}, {"additional_headers": {"Authorization": "Bearer nope"}}]:
        with pytest.raises(InvalidStatus) as info:
            await websockets.connect(server.url, **kw)
        assert info.value.response.status_code == 401
    with pytest.raises(Unauthorized):
        await connect(server.url, api_key="wrong")
    async with await connect(server.url, api_key=KEY) as client:  # header, no Origin
        assert client.hello.model == engine.model_name
    async with websockets.connect(f"{server.url}?api_key={KEY}",
                                  origin="http://good.example:1") as ws:  # a listed page
        assert json.loads(await ws.recv())["type"] == "hello"
    with pytest.raises(InvalidStatus) as info:  # a foreign page, even with the key
        await websockets.connect(f"{server.url}?api_key={KEY}", origin="http://evil.example")
    assert info.value.response.status_code == 403
    assert (await http_get(port, f"/?api_key={KEY}", {"Origin": "http://evil.example"}))[0] == 403


async def test_cors_lets_allowed_browser_pages_call_the_http_routes(make_server):
    engine, server = await make_server(_config(api_key=KEY,
                                               allowed_origins=("http://good.example:1",)))
    base = f"http://127.0.0.1:{server.port}"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.options("/v1/chat/completions",
                               headers={"Origin": "http://good.example:1", **preflight})
        assert r.status_code == 200, r.text  # no key needed for a preflight
        assert r.headers["access-control-allow-origin"] == "http://good.example:1"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert "POST" in r.headers["access-control-allow-methods"]
        r = await http.options("/v1/chat/completions",
                               headers={"Origin": "http://evil.example", **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers={"Origin": "http://good.example:1", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "http://good.example:1"
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 403  # the guard still refuses a foreign page


async def test_api_key_never_reaches_the_logs(make_server, caplog):
    engine, server = await make_server(_config(api_key=KEY))
    with caplog.at_level(logging.DEBUG, logger="websockets.server"), \
            structlog.testing.capture_logs() as logs:
        async with websockets.connect(f"{server.url}?api_key={KEY}") as ws:
            await ws.recv()
            await ws.send(generate_frame("r", max_tokens=2))
            while json.loads(await ws.recv())["type"] != "done":
                pass
        async with await connect(server.url, api_key=KEY):
            pass
        for path in [f"/?api_key={KEY}", "/metrics?api_key=wrong-" + KEY]:
            await http_get(server.port, path)
        with pytest.raises(InvalidStatus):
            await websockets.connect(f"{server.url}?api_key=x{KEY}")
    assert "GET /v1/stream?api_key=***" in caplog.text  # websockets' debug lines did run
    assert KEY not in caplog.text
    assert logs and KEY not in repr(logs)
    await wait_idle(engine)
