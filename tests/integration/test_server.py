"""The real server on port 0 with the real model, spoken to over a real WebSocket."""

from __future__ import annotations

import asyncio
import json

import websockets

from protocol import Delta, Done, connect


async def _collect(stream) -> tuple[list[Delta], Done]:
    deltas: list[Delta] = []
    async for ev in stream:
        if isinstance(ev, Delta):
            deltas.append(ev)
        else:
            return deltas, ev
    raise AssertionError("stream ended without done")


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.num_unfinished or engine.scheduler.has_unfinished():
        assert asyncio.get_running_loop().time() < deadline, "engine did not go idle"
        await asyncio.sleep(0.02)


async def test_hello_health_and_paris(make_server):
    engine, server = await make_server()
    async with await connect(server.url) as client:
        assert client.hello.model == "SmolLM2-135M-Instruct"
        assert client.hello.max_model_len == 8192
        stream = client.generate(messages=[{"role": "user",
                                            "content": "What is the capital of France?"}],
                                 max_tokens=24, temperature=0)
        deltas, done = await _collect(stream)
    text = "".join(d.text for d in deltas)
    assert "Paris" in text
    assert len([d for d in deltas if d.text]) > 1, "the answer must stream in several deltas"
    assert done.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.timings.ttft_ms is not None and done.timings.e2e_ms >= done.timings.ttft_ms
    # /health on the same port
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head = await reader.read(4096)
    writer.close()
    assert head.startswith(b"HTTP/1.1 200") and b'"ok"' in head


async def test_eight_requests_multiplexed_get_exactly_max_tokens(make_server):
    engine, server = await make_server(max_num_seqs=8)
    async with await connect(server.url) as client:
        streams = [client.generate(prompt=f"Count with me: {i}, {i + 1},", max_tokens=12 + i,
                                   ignore_eos=True, temperature=0, id=f"r{i}")
                   for i in range(8)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
    for i, (deltas, done) in enumerate(results):
        toks = [t for d in deltas for t in d.token_ids]
        assert len(toks) == 12 + i and done.usage.completion_tokens == 12 + i
        assert done.finish_reason == "length" and done.id == f"r{i}"
        assert [d.index for d in deltas] == sorted(d.index for d in deltas)
        assert all(d.id == f"r{i}" for d in deltas)
    await _wait_idle(engine)


async def test_cancel_mid_stream(make_server):
    engine, server = await make_server()
    async with await connect(server.url) as client:
        stream = client.generate(prompt="Tell me a long story.", max_tokens=500,
                                 ignore_eos=True, id="long")
        n = 0
        done = None
        async for ev in stream:
            if isinstance(ev, Delta):
                n += len(ev.token_ids)
                if n == 3:
                    await client.cancel("long")
            else:
                done = ev
        assert done is not None and done.finish_reason == "cancelled"
        assert 3 <= done.usage.completion_tokens < 500
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
    async with websockets.connect(server.url) as ws:
        json.loads(await ws.recv())
        bad = [
            "not json at all",
            b"\xff\xfe binary garbage",
            json.dumps([1, 2, 3]),
            json.dumps({"type": "nope"}),
            json.dumps({"type": "generate", "id": "x", "prompt": "hi",
                        "params": {"max_tokens": "ten"}}),
            json.dumps({"type": "generate", "id": "y", "prompt": "hi",
                        "params": {"temperature": -1}}),
            json.dumps({"type": "generate", "id": "z", "prompt_token_ids": []}),
            json.dumps({"type": "generate", "id": "w", "prompt_token_ids": [10 ** 9]}),
        ]
        for frame in bad:
            await ws.send(frame)
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == "invalid_request", (frame, err)
        assert err["id"] == "w" and err["param"] == "$.prompt_token_ids[0]"
        # too long for the context
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "hi",
                                  "params": {"max_tokens": 9000}}))
        err = json.loads(await ws.recv())
        assert err["code"] == "context_length_exceeded" and err["id"] == "big"
        # the socket still works: a real request, and a chat message with empty content
        await ws.send(json.dumps({"type": "generate", "id": "ok",
                                  "messages": [{"role": "user", "content": ""}],
                                  "params": {"max_tokens": 1}}))
        kinds = []
        while not kinds or kinds[-1] != "done":
            kinds.append(json.loads(await ws.recv())["type"])
        assert kinds[0] == "accepted" and kinds[-1] == "done"
        await ws.send(json.dumps({"type": "ping", "t": 1.5}))
        assert json.loads(await ws.recv()) == {"type": "pong", "t": 1.5}


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
