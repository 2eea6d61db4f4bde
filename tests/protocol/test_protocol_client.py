"""The client against a scripted fake server (see conftest.py) on real sockets."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from protocol import (
    Accepted,
    Client,
    ClientConnectionClosed,
    Delta,
    Done,
    DuplicateId,
    Error,
    InternalError,
    InvalidRequest,
    Overloaded,
    Stream,
    Timings,
    Unauthorized,
    Usage,
    connect,
)


def done(request_id: str, reason: str = "stop", completion_tokens: int = 2) -> Done:
    return Done(
        id=request_id,
        finish_reason=reason,  # type: ignore[arg-type]
        usage=Usage(
            prompt_tokens=3,
            completion_tokens=completion_tokens,
            total_tokens=3 + completion_tokens,
        ),
        timings=Timings(queue_ms=1.0, ttft_ms=2.0, tpot_ms=3.0, e2e_ms=4.0),
    )


def delta(request_id: str, index: int, text: str) -> Delta:
    return Delta(id=request_id, index=index, text=text, token_ids=[100 + index])


async def collect(stream: Stream) -> list[Delta | Done]:
    return [event async for event in stream]


@pytest.fixture
async def client(fake_server: Any) -> AsyncIterator[Client]:
    async with await connect(fake_server.url) as c:
        yield c


async def test_connect_reads_hello(client: Client) -> None:
    assert (client.hello.model, client.hello.max_model_len) == ("fake-model", 64)


async def test_api_key_goes_in_the_authorization_header(fake_server: Any) -> None:
    async with await connect(fake_server.url, api_key="k-123"):
        assert fake_server.headers["Authorization"] == "Bearer k-123"


async def test_error_instead_of_hello_raises_it(fake_server: Any) -> None:
    fake_server.first_frame = Error(
        id=None, code="unauthorized", param=None, message="bad key", retryable=False
    )
    with pytest.raises(Unauthorized, match="bad key"):
        await connect(fake_server.url)


async def test_two_interleaved_streams_on_one_socket(client: Client, fake_server: Any) -> None:
    a = client.generate(prompt="first", id="a", max_tokens=5)
    b = client.generate(messages=[{"role": "user", "content": "second"}], temperature=0)
    got_a = asyncio.create_task(collect(a))
    got_b = asyncio.create_task(collect(b))
    sent = {(await fake_server.recv())["id"]: None for _ in range(2)}
    assert set(sent) == {"a", b.id} and b.id != "a"

    await fake_server.send(
        Accepted(id=b.id, prompt_tokens=4),
        Accepted(id="a", prompt_tokens=3),
        delta("a", 0, "A0"),
        delta(b.id, 0, "B0"),
        delta("a", 1, "A1"),
        done(b.id, completion_tokens=1),
        delta("a", 2, "A2"),
        done("a", completion_tokens=3),
    )
    events_a, events_b = await got_a, await got_b
    assert [e.text for e in events_a[:-1]] == ["A0", "A1", "A2"]  # type: ignore[union-attr]
    assert [e.text for e in events_b[:-1]] == ["B0"]  # type: ignore[union-attr]
    assert events_a[-1] == done("a", completion_tokens=3) == a.done
    assert events_b[-1] == done(b.id, completion_tokens=1) == b.done
    assert (a.prompt_tokens, b.prompt_tokens) == (3, 4)


async def test_sent_frame_carries_prompt_and_params(client: Client, fake_server: Any) -> None:
    stream = client.generate(prompt_token_ids=(5, 6), id="p", max_tokens=4, stop=["\n"])
    task = asyncio.create_task(collect(stream))
    frame = await fake_server.recv()
    assert frame["type"] == "generate" and frame["prompt_token_ids"] == [5, 6]
    assert (frame["params"]["max_tokens"], frame["params"]["stop"]) == (4, ["\n"])
    assert "prompt" not in frame and "messages" not in frame
    await fake_server.send(Accepted(id="p", prompt_tokens=2), done("p", completion_tokens=0))
    assert await task == [done("p", completion_tokens=0)]


async def test_error_before_accepted_raises_its_class(client: Client, fake_server: Any) -> None:
    stream = client.generate(prompt="x", id="r1")
    task = asyncio.create_task(collect(stream))
    await fake_server.recv()
    await fake_server.send(
        Error(
            id="r1",
            code="overloaded",
            param=None,
            message="queue full",
            retryable=True,
            retry_after_ms=250,
        )
    )
    with pytest.raises(Overloaded) as info:
        await task
    assert (info.value.retry_after_ms, info.value.request_id) == (250, "r1")
    # The id is free again: a new request may use it.
    again = asyncio.create_task(collect(client.generate(prompt="x", id="r1")))
    assert (await fake_server.recv())["id"] == "r1"
    await fake_server.send(Accepted(id="r1", prompt_tokens=1), done("r1", completion_tokens=0))
    assert len(await again) == 1


async def test_error_after_accepted_is_kept_and_done_follows(
    client: Client, fake_server: Any
) -> None:
    stream = client.generate(prompt="x", id="r1")
    task = asyncio.create_task(collect(stream))
    await fake_server.recv()
    await fake_server.send(
        Accepted(id="r1", prompt_tokens=3),
        delta("r1", 0, "hi"),
        Error(id="r1", code="internal_error", param=None, message="boom", retryable=False),
        done("r1", reason="error", completion_tokens=1),
    )
    events = await task
    assert [type(e) for e in events] == [Delta, Done]
    assert events[-1].finish_reason == "error"  # type: ignore[union-attr]
    assert isinstance(stream.error, InternalError) and stream.error.message == "boom"


async def test_aclose_sends_cancel_and_drops_the_rest(client: Client, fake_server: Any) -> None:
    stream = client.generate(prompt="x", id="r1")
    first = asyncio.create_task(stream.__anext__())
    await fake_server.recv()
    await fake_server.send(Accepted(id="r1", prompt_tokens=3), delta("r1", 0, "a"))
    assert (await first).text == "a"  # type: ignore[union-attr]
    await stream.aclose()
    assert await fake_server.recv() == {"type": "cancel", "id": "r1"}
    # Until its done arrives the id is still in flight on the server, so here too.
    with pytest.raises(DuplicateId):
        await client.generate(prompt="x", id="r1").__anext__()
    await fake_server.send(delta("r1", 1, "b"), done("r1", reason="cancelled"))
    await client.ping()  # frames arrive in order: the done has been handled
    reuse = asyncio.create_task(collect(client.generate(prompt="y", id="r1")))
    assert (await fake_server.recv())["prompt"] == "y"
    await fake_server.send(Accepted(id="r1", prompt_tokens=1), done("r1", completion_tokens=0))
    assert await reuse == [done("r1", completion_tokens=0)]


async def test_async_with_break_sends_cancel(client: Client, fake_server: Any) -> None:
    stream = client.generate(prompt="x", id="w")

    async def read_one() -> None:
        async with stream:
            async for _ in stream:
                break

    task = asyncio.create_task(read_one())
    await fake_server.recv()
    await fake_server.send(Accepted(id="w", prompt_tokens=1), delta("w", 0, "a"))
    await task
    assert await fake_server.recv() == {"type": "cancel", "id": "w"}


async def test_dropped_stream_sends_cancel(client: Client, fake_server: Any) -> None:
    async def read_one() -> None:
        async for _ in client.generate(prompt="x", id="g"):
            break  # the stream is dropped; asyncio finalizes its generator

    # No garbage collection may do it: the stream must be freed by reference counting
    # (a reference cycle once kept it, and the request running, until the next collection).
    gc.disable()
    try:
        task = asyncio.create_task(read_one())
        await fake_server.recv()
        await fake_server.send(Accepted(id="g", prompt_tokens=1), delta("g", 0, "a"))
        await task
        assert await asyncio.wait_for(fake_server.recv(), 5) == {"type": "cancel", "id": "g"}
    finally:
        gc.enable()


async def test_cancel_ends_the_stream_with_the_servers_done(
    client: Client, fake_server: Any
) -> None:
    stream = client.generate(prompt="x", id="c")
    task = asyncio.create_task(collect(stream))
    await fake_server.recv()
    await client.cancel("c")
    assert await fake_server.recv() == {"type": "cancel", "id": "c"}
    await fake_server.send(Accepted(id="c", prompt_tokens=1), done("c", "cancelled", 0))
    assert await task == [done("c", "cancelled", 0)]


async def test_ping_measures_a_round_trip(client: Client) -> None:
    rtts = await asyncio.gather(client.ping(), client.ping(), client.ping())
    assert all(rtt >= 0 for rtt in rtts)


async def test_server_close_ends_every_stream(client: Client, fake_server: Any) -> None:
    tasks = [
        asyncio.create_task(collect(client.generate(prompt="x", id=i))) for i in ("a", "b")
    ]
    await fake_server.recv()
    await fake_server.recv()
    await fake_server.send(Accepted(id="a", prompt_tokens=1), delta("a", 0, "x"))
    await fake_server.close(1011, "engine died")
    for task in tasks:
        with pytest.raises(ClientConnectionClosed) as info:
            await task
        assert info.value.close_code == 1011
    with pytest.raises(ClientConnectionClosed):
        await client.generate(prompt="x").__anext__()
    with pytest.raises(ClientConnectionClosed):
        await client.ping()
    with pytest.raises(ClientConnectionClosed):
        await client.cancel("a")


async def test_client_close_ends_every_stream(fake_server: Any) -> None:
    client = await connect(fake_server.url)
    task = asyncio.create_task(collect(client.generate(prompt="x")))
    await fake_server.recv()
    await client.close()
    await client.close()  # idempotent
    with pytest.raises(ClientConnectionClosed) as info:
        await task
    assert info.value.close_code == 1000


async def test_bad_server_frame_closes_with_1002(client: Client, fake_server: Any) -> None:
    task = asyncio.create_task(collect(client.generate(prompt="x")))
    await fake_server.recv()
    await fake_server.send_raw('{"type": "delta", "id": 5}')
    with pytest.raises(ClientConnectionClosed) as info:
        await task
    assert info.value.close_code == 1002


async def test_bad_request_is_refused_before_sending(client: Client) -> None:
    with pytest.raises(InvalidRequest) as info:
        client.generate(prompt="x", max_tokens=0)
    assert info.value.param == "$.params.max_tokens"
    with pytest.raises(InvalidRequest) as info:
        client.generate(prompt="x", messages=[{"role": "user", "content": "y"}])
    assert info.value.param is None
    with pytest.raises(InvalidRequest) as info:
        client.generate(prompt="x", id="")
    assert info.value.param == "$.id"
    with pytest.raises(TypeError, match="max_token"):
        client.generate(prompt="x", max_token=5)
    with pytest.raises(InvalidRequest):
        await client.cancel("")
