"""Client-side checks of the /v1/stream protocol, run against any endpoint.

The single-process server's tests (test_server.py) and the cluster's
(tests/cluster/) call the same bodies, so both endpoints are held to the same
behaviour: only what a client can see is checked here; each caller adds its own
engine-side checks (blocks returned, engine idle).
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import websockets

from protocol import Delta, Done, connect


async def collect(stream) -> tuple[list[Delta], Done]:
    deltas: list[Delta] = []
    async for ev in stream:
        if isinstance(ev, Delta):
            deltas.append(ev)
        else:
            return deltas, ev
    raise AssertionError("stream ended without done")


async def http_get(url: str) -> bytes:
    """The whole response (status line, headers, body) to a plain GET."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(f"GET {parts.path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.read(), 30)  # until EOF: "Connection: close"
    writer.close()
    return head


async def check_hello_health_and_paris(url: str, health_url: str) -> None:
    async with await connect(url) as client:
        assert client.hello.model == "SmolLM2-135M-Instruct"
        assert client.hello.max_model_len == 8192
        stream = client.generate(messages=[{"role": "user",
                                            "content": "What is the capital of France?"}],
                                 max_tokens=24, temperature=0)
        deltas, done = await collect(stream)
    text = "".join(d.text for d in deltas)
    assert "Paris" in text
    assert len([d for d in deltas if d.text]) > 1, "the answer must stream in several deltas"
    assert done.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.timings.ttft_ms is not None and done.timings.e2e_ms >= done.timings.ttft_ms
    head = await http_get(health_url)
    assert head.startswith(b"HTTP/1.1 200") and b'"ok"' in head


async def check_eight_requests_multiplexed(url: str) -> None:
    async with await connect(url) as client:
        streams = [client.generate(prompt=f"Count with me: {i}, {i + 1},", max_tokens=12 + i,
                                   ignore_eos=True, temperature=0, id=f"r{i}")
                   for i in range(8)]
        results = await asyncio.gather(*(collect(s) for s in streams))
    for i, (deltas, done) in enumerate(results):
        toks = [t for d in deltas for t in d.token_ids]
        assert len(toks) == 12 + i and done.usage.completion_tokens == 12 + i
        assert done.finish_reason == "length" and done.id == f"r{i}"
        assert [d.index for d in deltas] == sorted(d.index for d in deltas)
        assert all(d.id == f"r{i}" for d in deltas)


async def check_cancel_mid_stream(url: str) -> None:
    async with await connect(url) as client:
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


async def check_bad_frames(url: str) -> None:
    async with websockets.connect(url) as ws:
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
