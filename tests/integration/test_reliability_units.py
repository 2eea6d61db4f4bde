"""Reliability pieces without the model: the bounded outbox, access checks, key redaction,
the server settings and the `serve` network flags."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import msgspec
import pytest

from protocol import (Accepted, Delta, Done, InternalError, Pong, Timings, Usage,
                      decode_server_frame)
from service.front.access import AccessPolicy, RedactingLogger, normalize_origin, redact
from service.engine_args import build_parser, server_config
from service.front.serve import on_shutdown_signals
from service.config import ServerConfig
from service.front.ws.outbox import DELTA_OVERHEAD_BYTES, Outbox


def _delta(rid: str, index: int, text: str, tok: int) -> Delta:
    return Delta(id=rid, index=index, text=text, token_ids=[tok])


def _done(rid: str) -> Done:
    return Done(id=rid, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1,
                                                            total_tokens=2), timings=Timings())


class _GatedSocket:
    """A `send` that blocks until the test opens the gate, as a full transport buffer does."""

    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []
        self.gate = asyncio.Event()

    async def send(self, data: bytes) -> None:
        await self.gate.wait()
        self.sent.append(decode_server_frame(data))


async def _run_until_sent(box: Outbox, sock: _GatedSocket, n: int) -> asyncio.Task:
    task = asyncio.create_task(box.run(sock.send))
    for _ in range(200):
        if len(sock.sent) >= n:
            break
        await asyncio.sleep(0)
    return task


async def test_outbox_merges_deltas_while_the_socket_waits_and_loses_nothing() -> None:
    box, sock = Outbox(), _GatedSocket()
    writer = asyncio.create_task(box.run(sock.send))
    box.put(Accepted(id="a", prompt_tokens=3))
    await asyncio.sleep(0)  # the writer takes `accepted` and blocks in send
    words = ["The", " cat", " sat", " on", " é", "🎉"]
    for i, w in enumerate(words):
        box.put(_delta("a", i, w, 100 + i))
        box.put(_delta("b", i, w.upper(), 200 + i))
    box.put(Pong(t=1.0))
    box.put(_done("a"))
    box.put(_delta("b", 6, "!", 206))  # after a's done: b's deltas still merge, a's may not
    assert box.merged_deltas == 2 * len(words) - 2 + 1
    assert box.pending_bytes > 0
    sock.gate.set()
    await asyncio.wait_for(box.drain(5), 5)
    writer.cancel()
    kinds = [(type(m).__name__, getattr(m, "id", None)) for m in sock.sent]
    assert kinds == [("Accepted", "a"), ("Delta", "a"), ("Delta", "b"), ("Pong", None),
                     ("Done", "a")]
    a, b = sock.sent[1], sock.sent[2]
    assert a.text == "".join(words) and a.token_ids == [100 + i for i in range(6)] and a.index == 0
    assert b.text == "".join(w.upper() for w in words) + "!"
    assert b.token_ids == [200 + i for i in range(7)]
    assert box.pending_bytes == 0


async def test_outbox_merges_logprobs_with_their_tokens() -> None:
    from protocol import TokenLogprob

    box, sock = Outbox(), _GatedSocket()
    first = TokenLogprob(-0.1, [(7, -0.1)])
    box.put(Delta(id="a", index=0, text="x", token_ids=[7], logprobs=[first],
                  prompt_logprobs=[None, TokenLogprob(-2.0, [])], prompt_token_ids=[1, 2]))
    box.put(Delta(id="a", index=1, text="y", token_ids=[8], logprobs=[TokenLogprob(-0.2, [])]))
    box.put(_delta("b", 0, "z", 9))
    sock.gate.set()
    task = await _run_until_sent(box, sock, 2)
    task.cancel()
    a, b = sock.sent
    assert a.token_ids == [7, 8] and [lp.logprob for lp in a.logprobs] == [-0.1, -0.2]
    assert a.prompt_logprobs[1].logprob == -2.0 and a.prompt_token_ids == [1, 2]
    assert b.logprobs is None and b.prompt_logprobs is None


async def test_outbox_keeps_and_merges_tool_call_pieces() -> None:
    """A delta's tool-call pieces survive the outbox, alone or merged: the arguments'
    concatenation is the call's text (PROTOCOL.md, `done`)."""
    from protocol.structured import FunctionCallDelta, ToolCallDelta

    def piece(i: int, args: str, name: str | None = None) -> ToolCallDelta:
        return ToolCallDelta(index=i, id=f"call_{i}" if name else None,
                             type="function" if name else None,
                             function=FunctionCallDelta(name=name, arguments=args))

    box, sock = Outbox(), _GatedSocket()
    box.put(Delta(id="a", index=0, text="", token_ids=[1], tool_calls=[piece(0, "", "f")]))
    box.put(Delta(id="a", index=1, text="", token_ids=[2], tool_calls=[piece(0, '{"x": ')]))
    box.put(Delta(id="a", index=2, text="", token_ids=[3], tool_calls=[piece(0, "1}")]))
    box.put(Delta(id="a", index=3, text="", token_ids=[4],
                  tool_calls=[piece(1, "", "g"), piece(1, "{}")]))
    box.put(_delta("b", 0, "z", 9))
    before = box.pending_bytes
    sock.gate.set()
    task = await _run_until_sent(box, sock, 2)
    task.cancel()
    a, b = sock.sent
    assert a.token_ids == [1, 2, 3, 4] and b.tool_calls is None
    assert [(p.index, p.id, p.function.name, p.function.arguments) for p in a.tool_calls] == [
        (0, "call_0", "f", '{"x": 1}'), (1, "call_1", "g", "{}")]
    assert before > 0 and box.pending_bytes == 0
    # a delta sent on its own keeps its pieces too
    box, sock = Outbox(), _GatedSocket()
    box.put(Delta(id="c", index=0, text="", token_ids=[5], tool_calls=[piece(0, "{}", "h")]))
    sock.gate.set()
    task = await _run_until_sent(box, sock, 1)
    task.cancel()
    assert sock.sent[0].tool_calls[0].function.arguments == "{}"


async def test_outbox_never_merges_across_a_frame_of_the_same_request() -> None:
    box, sock = Outbox(), _GatedSocket()
    box.put(_delta("a", 0, "x", 1))
    box.put(InternalError("m", request_id="a").to_frame())
    box.put(_delta("a", 1, "y", 2))  # not a real stream (nothing follows an error but done):
    box.put(_done("a"))              # it checks that no delta jumps ahead of another frame
    sock.gate.set()
    task = await _run_until_sent(box, sock, 4)
    task.cancel()
    assert [type(m).__name__ for m in sock.sent] == ["Delta", "Error", "Delta", "Done"]
    assert [m.text for m in sock.sent if isinstance(m, Delta)] == ["x", "y"]


async def test_outbox_overflow_drops_everything_and_reports_once() -> None:
    calls: list[int] = []
    box = Outbox(max_bytes=2000, on_overflow=lambda: calls.append(1))
    i = 0
    while not box.overflowed:
        box.put(_delta(f"r{i % 3}", i, "word ", i))  # nobody sends: the reader is gone quiet
        box.put(Pong(t=float(i)))  # pongs count as well: a ping flood cannot grow it forever
        i += 1
        assert i < 10_000
    assert calls == [1] and box.closed and box.pending_bytes == 0
    box.put(_done("r0"))
    box.put(_delta("r1", 0, "late", 1))
    assert calls == [1] and box.pending_bytes == 0
    sock = _GatedSocket()
    sock.gate.set()
    await asyncio.wait_for(box.run(sock.send), 1)  # a closed outbox's writer returns at once
    assert sock.sent == []


async def test_outbox_pending_bytes_estimate_tracks_queued_frames() -> None:
    box = Outbox()
    box.put(_delta("a", 0, "héllo", 1))
    assert box.pending_bytes == len("héllo".encode()) + 8 + DELTA_OVERHEAD_BYTES
    box.put(_delta("a", 1, "!", 2))
    assert box.pending_bytes == len("héllo!".encode()) + 16 + DELTA_OVERHEAD_BYTES
    assert not await box.drain(0.01)  # nothing sends: not drained
    with pytest.raises(ValueError, match="max_bytes"):
        Outbox(max_bytes=0)


def test_access_policy_key_from_header_or_query() -> None:
    p = AccessPolicy("s3cr3t-ключ")
    assert p.requires_key
    assert p.key_ok("Bearer s3cr3t-ключ", "")
    assert p.key_ok("bearer   s3cr3t-ключ ", "")
    assert p.key_ok(None, "x=1&api_key=s3cr3t-%D0%BA%D0%BB%D1%8E%D1%87")
    assert not p.key_ok(None, "")
    assert not p.key_ok("Bearer wrong", "")
    assert not p.key_ok("Basic s3cr3t-ключ", "")
    assert not p.key_ok(None, "api_key=")
    assert not p.key_ok(None, "api_key=s3cr3t")
    assert not p.key_ok("Bearer wrong", "api_key=s3cr3t-%D0%BA%D0%BB%D1%8E%D1%87")  # header wins
    assert AccessPolicy(None).key_ok(None, "")


def test_access_policy_origins() -> None:
    p = AccessPolicy(None, ["http://127.0.0.1:8765", "HTTPS://Chat.Example.com"])
    assert p.origin_allowed(None)  # not a browser
    assert p.origin_allowed("http://127.0.0.1:8765")
    assert p.origin_allowed("https://chat.example.com")
    assert not p.origin_allowed("http://127.0.0.1:8766")
    assert not p.origin_allowed("https://evil.example")
    assert not p.origin_allowed("null")
    assert not p.origin_allowed("http://127.0.0.1:8765/")
    assert AccessPolicy(None, []).origin_allowed("https://anything.example")
    assert normalize_origin("HTTP://A.b:80") == "http://a.b:80"
    for bad in ["127.0.0.1:8765", "ftp://x", "http://x/path", "http://", "*"]:
        with pytest.raises(ValueError, match="origin"):
            normalize_origin(bad)


def test_redact_scrubs_query_keys_and_authorization_headers() -> None:
    assert redact("< GET /v1/stream?api_key=abc%2Bdef&x=1 HTTP/1.1") == \
        "< GET /v1/stream?api_key=***&x=1 HTTP/1.1"
    assert redact("< Authorization: Bearer abc.def") == "< Authorization: Bearer ***"
    assert redact("< authorization: abc") == "< authorization: ***"
    assert redact("nothing here") == "nothing here"


def test_redacting_logger_formats_then_scrubs(caplog: pytest.LogCaptureFixture) -> None:
    base = logging.getLogger("test_reliability.ws")
    logger = RedactingLogger(base)
    with caplog.at_level(logging.DEBUG, logger="test_reliability.ws"):
        logger.debug("< %s %s %s", "GET", "/v1/stream?api_key=TOPSECRET", "HTTP/1.1")
        logger.debug("< %s: %s", "Authorization", "Bearer TOPSECRET")
        logger.info("plain %d", 5)
    assert "TOPSECRET" not in caplog.text
    assert "api_key=***" in caplog.text and "Bearer ***" in caplog.text and "plain 5" in caplog.text


def test_server_config_validates_and_hides_the_key() -> None:
    c = ServerConfig(api_key="hunter2-key", allowed_origins=("http://127.0.0.1:1",))
    assert "hunter2" not in repr(c)
    for kw, field in [({"max_connections": 0}, "max_connections"),
                      ({"max_outbox_bytes": 10}, "max_outbox_bytes"),
                      ({"api_key": "has space"}, "api_key"),
                      ({"api_key": ""}, "api_key"),
                      ({"shutdown_timeout": -1}, "shutdown_timeout"),
                      ({"allowed_origins": ("example.com",)}, "origin")]:
        with pytest.raises(ValueError, match=field) as info:
            ServerConfig(**kw)
        assert "has space" not in str(info.value)


def test_serve_flags_build_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    a = build_parser().parse_args([
        "serve", "--port", "0", "--max-connections", "7", "--max-outbox-bytes", "64KiB",
        "--max-message-bytes", "2MiB", "--max-requests-per-connection", "3",
        "--allowed-origins", "http://127.0.0.1:9, https://x.example", "--shutdown-timeout", "1.5"])
    c = server_config(a)
    assert (c.max_connections, c.max_outbox_bytes, c.max_message_bytes) == (7, 65536, 2 << 20)
    assert c.max_requests_per_connection == 3 and c.shutdown_timeout == 1.5
    assert c.allowed_origins == ("http://127.0.0.1:9", "https://x.example")
    assert c.api_key is None and c.host == "127.0.0.1"
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert server_config(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert server_config(build_parser().parse_args(["serve", "--api-key", "k"])).api_key == "k"


async def test_first_signal_drains_second_forces() -> None:
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    on_shutdown_signals(stop, force)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 10)
        assert not force.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(force.wait(), 10)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
