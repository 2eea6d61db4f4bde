"""The real server on port 0 with the real model, spoken to over a real WebSocket."""

from __future__ import annotations

import asyncio
import json

import websockets

from protocol import connect
from tests.integration.stream_checks import (check_bad_frames, check_cancel_mid_stream,
                                             check_eight_requests_multiplexed,
                                             check_hello_health_and_paris)
from tests.integration.stream_checks import collect as _collect


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.num_unfinished or engine.scheduler.has_unfinished():
        assert asyncio.get_running_loop().time() < deadline, "engine did not go idle"
        await asyncio.sleep(0.02)


async def test_hello_health_and_paris(make_server):
    engine, server = await make_server()
    await check_hello_health_and_paris(server.url, f"http://127.0.0.1:{server.port}/health")


async def test_eight_requests_multiplexed_get_exactly_max_tokens(make_server):
    engine, server = await make_server(max_num_seqs=8)
    await check_eight_requests_multiplexed(server.url)
    await _wait_idle(engine)


async def test_cancel_mid_stream(make_server):
    engine, server = await make_server()
    await check_cancel_mid_stream(server.url)
    await _wait_idle(engine)


async def test_closing_socket_returns_every_block(make_server):
    engine, server = await make_server()
    ws = await websockets.connect(server.url)
    await ws.recv()  # hello
    for i in range(4):
        await ws.send(json.dumps({"type": "generate", "id": f"g{i}", "prompt": "Hello there",
                                  "params": {"max_tokens": 400, "ignore_eos": True}}))
    seen = 0
    while seen < 8:  # wait until tokens flow, so blocks are really held
        msg = json.loads(await ws.recv())
        seen += msg["type"] == "delta"
    assert engine.scheduler.pool.usage > 0
    await ws.close()
    await _wait_idle(engine)
    engine.scheduler.check_integrity()
    assert engine.scheduler.pool.usage == 0.0


async def test_bad_frames_get_invalid_request_and_socket_keeps_working(make_server):
    engine, server = await make_server()
    await check_bad_frames(server.url)


async def test_duplicate_id_rejected_old_request_goes_on(make_server):
    engine, server = await make_server()
    async with websockets.connect(server.url) as ws:
        await ws.recv()
        frame = {"type": "generate", "id": "same", "prompt": "Hi",
                 "params": {"max_tokens": 20, "ignore_eos": True}}
        await ws.send(json.dumps(frame))
        await ws.send(json.dumps(frame))
        got = []
        while True:
            msg = json.loads(await ws.recv())
            got.append(msg)
            if msg["type"] == "done":
                break
        errors = [m for m in got if m["type"] == "error"]
        assert len(errors) == 1 and errors[0]["code"] == "duplicate_id"
        assert got[-1]["usage"]["completion_tokens"] == 20


async def test_unicode_stream_has_no_replacement_chars(make_server, tokenizer):
    engine, server = await make_server()
    async with await connect(server.url) as client:
        for prompt in ["🎉🎉🎉 🎉🎉🎉 🎉🎉", "你好，世界。你好，世界。你好，世界。你好"]:
            deltas, done = await _collect(client.generate(prompt=prompt, max_tokens=24,
                                                          temperature=0, ignore_eos=True))
            text = "".join(d.text for d in deltas)
            toks = [t for d in deltas for t in d.token_ids]
            assert "\ufffd" not in text
            assert text == tokenizer.decode(toks, skip_special_tokens=True)
            assert any(ord(c) > 0x2E80 for c in text), text  # the output really has emoji/CJK


async def test_stop_string_spanning_tokens_is_never_streamed(make_server, tokenizer):
    engine, server = await make_server()
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    async with await connect(server.url) as client:
        free, _ = await _collect(client.generate(prompt=prompt, max_tokens=16, temperature=0))
        full = "".join(d.text for d in free)
        # pick a stop string that spans a token boundary in the free output
        stop = "10, 11"
        assert stop in full, full
        deltas, done = await _collect(client.generate(prompt=prompt, max_tokens=16,
                                                      temperature=0, stop=[stop]))
    text = "".join(d.text for d in deltas)
    assert done.finish_reason == "stop"
    assert stop not in text and text == full[:full.index(stop)]


async def test_seeded_sampling_same_alone_and_in_batch(make_server):
    engine, server = await make_server()
    params = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    async with await connect(server.url) as client:
        alone, _ = await _collect(client.generate(prompt="My favourite animal is", **params))
        others = [client.generate(prompt=f"Write about topic {i}:", max_tokens=20,
                                  temperature=1.0, ignore_eos=True) for i in range(5)]
        target = client.generate(prompt="My favourite animal is", **params)
        results = await asyncio.gather(_collect(target), *(_collect(o) for o in others))
    batched = results[0][0]
    assert [t for d in batched for t in d.token_ids] == [t for d in alone for t in d.token_ids]
    assert "".join(d.text for d in batched) == "".join(d.text for d in alone)


async def test_max_tokens_one(make_server):
    engine, server = await make_server()
    async with await connect(server.url) as client:
        deltas, done = await _collect(client.generate(prompt="Hi", max_tokens=1))
    assert done.usage.completion_tokens == 1 and done.finish_reason in ("length", "stop")


async def test_logprobs_are_refused_on_the_websocket_protocol(make_server):
    # PROTOCOL.md has no logprobs: asked for, they are an invalid_request, never dropped
    engine, server = await make_server()
    async with websockets.connect(server.url) as ws:
        await ws.recv()
        for i, name in enumerate(("logprobs", "prompt_logprobs")):
            await ws.send(json.dumps({"type": "generate", "id": f"r{i}", "prompt": "Hi",
                                      "params": {"max_tokens": 2, name: 1}}))
            msg = json.loads(await ws.recv())
            assert msg["type"] == "error" and msg["code"] == "invalid_request", msg
            assert msg["param"] == f"$.params.{name}" and msg["id"] == f"r{i}"
        # the socket goes on serving
        await ws.send(json.dumps({"type": "generate", "id": "ok", "prompt": "Hi",
                                  "params": {"max_tokens": 2, "ignore_eos": True}}))
        kinds = []
        while not kinds or kinds[-1] != "done":
            msg = json.loads(await ws.recv())
            kinds.append(msg["type"])
            assert "logprobs" not in msg
        assert kinds[0] == "accepted" and "delta" in kinds
