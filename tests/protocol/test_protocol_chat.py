"""The terminal chat loop against the scripted fake server (see conftest.py)."""

from __future__ import annotations

import asyncio
import io
from typing import Any

from protocol import Accepted, Delta, Done, Error, Timings, Usage, connect
from protocol.chat import Chat, summary


def done(request_id: str, reason: str, completion_tokens: int, timings: Timings) -> Done:
    return Done(
        id=request_id,
        finish_reason=reason,  # type: ignore[arg-type]
        usage=Usage(
            prompt_tokens=10,
            completion_tokens=completion_tokens,
            total_tokens=10 + completion_tokens,
            cached_tokens=6,
        ),
        timings=timings,
    )


TIMINGS = Timings(queue_ms=1.0, ttft_ms=48.4, tpot_ms=20.0, e2e_ms=70.0)


async def test_multi_turn_history_and_summary(fake_server: Any) -> None:
    out = io.StringIO()
    async with await connect(fake_server.url) as client:
        chat = Chat(client, out, system="Be brief.", params={"temperature": 0.0})
        run = asyncio.create_task(chat.run())
        chat.lines.put_nowait("Hi")
        first = await fake_server.recv()
        assert first["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ]
        assert first["params"]["temperature"] == 0.0
        rid = first["id"]
        await fake_server.send(
            Accepted(id=rid, prompt_tokens=10),
            Delta(id=rid, index=0, text="Hel", token_ids=[1]),
            Delta(id=rid, index=1, text="lo", token_ids=[2]),
            done(rid, "stop", 2, TIMINGS),
        )
        chat.lines.put_nowait("Again")
        second = await fake_server.recv()
        assert second["messages"][1:] == [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ]
        await fake_server.send(Accepted(id=second["id"], prompt_tokens=10))
        await fake_server.send(done(second["id"], "length", 0, Timings()))
        chat.lines.put_nowait(None)  # EOF
        await asyncio.wait_for(run, 10)
    text = out.getvalue()
    assert "Hello\n[stop · 2 tokens · ttft 48 ms · 50.0 tok/s · cached 6/10 prompt tokens]" in text
    assert "[length · 0 tokens · cached 6/10 prompt tokens]" in text


async def test_interrupt_cancels_the_answer_then_quits(fake_server: Any, eventually: Any) -> None:
    out = io.StringIO()
    async with await connect(fake_server.url) as client:
        chat = Chat(client, out)
        run = asyncio.create_task(chat.run())
        chat.lines.put_nowait("Tell me a story")
        rid = (await fake_server.recv())["id"]
        await fake_server.send(
            Accepted(id=rid, prompt_tokens=10), Delta(id=rid, index=0, text="Once", token_ids=[1])
        )
        await eventually(lambda: "Once" in out.getvalue())
        chat.interrupt()  # Ctrl-C while streaming
        assert await fake_server.recv() == {"type": "cancel", "id": rid}
        await fake_server.send(done(rid, "cancelled", 1, TIMINGS))
        await eventually(lambda: "[cancelled" in out.getvalue())
        assert chat.history[-1].content == "Once"
        chat.interrupt()  # Ctrl-C at the prompt
        await asyncio.wait_for(run, 10)


async def test_second_interrupt_stops_waiting(fake_server: Any, eventually: Any) -> None:
    out = io.StringIO()
    async with await connect(fake_server.url) as client:
        chat = Chat(client, out)
        ask = asyncio.create_task(chat.ask("Hi"))
        rid = (await fake_server.recv())["id"]
        await fake_server.send(Accepted(id=rid, prompt_tokens=10))
        await eventually(lambda: chat._stream is not None and chat._stream.prompt_tokens == 10)
        chat.interrupt()
        chat.interrupt()  # the server never answers the cancel: give up on it
        await asyncio.wait_for(ask, 10)
        assert "[stopped waiting for the server]" in out.getvalue()
        assert await fake_server.recv() == {"type": "cancel", "id": rid}


async def test_rejected_request_leaves_history_unchanged(fake_server: Any) -> None:
    out = io.StringIO()
    async with await connect(fake_server.url) as client:
        chat = Chat(client, out, system="S")
        ask = asyncio.create_task(chat.ask("x" * 100))
        rid = (await fake_server.recv())["id"]
        await fake_server.send(
            Error(
                id=rid,
                code="context_length_exceeded",
                param="$.params.max_tokens",
                message="too long",
                retryable=False,
            )
        )
        await asyncio.wait_for(ask, 10)
    assert [m.role for m in chat.history] == ["system"]
    assert "error: context_length_exceeded: too long" in out.getvalue()


def test_summary_leaves_out_missing_timings() -> None:
    line = summary(done("r", "cancelled", 0, Timings(queue_ms=2.0)))
    assert line == "[cancelled · 0 tokens · cached 6/10 prompt tokens]"


def test_api_key_defaults_to_the_environment_as_the_server_reads_it(monkeypatch) -> None:
    from protocol.chat import _parse_args

    monkeypatch.setenv("CONVEYOR_API_KEY", "k-env")
    assert _parse_args([]).api_key == "k-env"
    assert _parse_args(["--api-key", "k-flag"]).api_key == "k-flag"
    monkeypatch.delenv("CONVEYOR_API_KEY")
    assert _parse_args([]).api_key is None
