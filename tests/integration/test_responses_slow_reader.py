"""`/v1/responses` shares `/v1/stream`'s slow-reader handling (in-process server, real
model): a reader that stops reading gets its text deltas merged (no event lost, no gap in
`sequence_number`), and one past `max_outbox_bytes` is closed with 1008 and its response
cancelled, its KV blocks freed."""

from __future__ import annotations

import json
import time

import pytest
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter
from websockets.exceptions import ConnectionClosed

from service.config import ServerConfig

from tests.integration.reliability_support import small_window_connect, wait_idle, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

EVENT = TypeAdapter(ResponsesServerEvent)
COUNT = "Count from 1 to 300, separated by commas."


def responses_url(server) -> str:
    return server.url.replace("/v1/stream", "/v1/responses")


def create(**fields) -> str:
    return json.dumps({"type": "response.create", "input": COUNT, "temperature": 0, **fields})


async def test_a_stalled_reader_gets_merged_deltas_and_every_character(make_server) -> None:
    engine, server = await make_server(
        ServerConfig(port=0, socket_send_buffer_bytes=1024, write_limit_bytes=1024,
                     ping_interval=600))
    ws = await small_window_connect(responses_url(server), server.port, rcvbuf=1024)
    await ws.send(create(max_output_tokens=160))
    events = [EVENT.validate_json(await ws.recv())]
    while events[-1].type != "response.output_text.delta":
        events.append(EVENT.validate_json(await ws.recv()))
    conn = next(iter(server.connections))
    t0 = time.monotonic()  # stop reading until the backlog merged in the outbox
    await wait_until(lambda: (conn.outbox.merged_deltas > 0 and time.monotonic() - t0 > 1)
                     or not conn.runs, 600, "the stalled reader's backlog")
    while events[-1].type not in ("response.completed", "response.incomplete"):
        events.append(EVENT.validate_json(await ws.recv()))
    await ws.close()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output[0].content[0].text
    assert conn.outbox.merged_deltas > 0 and len(deltas) < final.usage.output_tokens
    await wait_idle(engine)


async def test_a_reader_past_the_outbox_limit_is_closed_1008_and_cancelled(make_server) -> None:
    engine, server = await make_server(
        ServerConfig(port=0, max_outbox_bytes=2048, write_limit_bytes=1024,
                     socket_send_buffer_bytes=4096, close_timeout=120, ping_interval=600))
    ws = await small_window_connect(responses_url(server), server.port, rcvbuf=2048)
    for lane in range(8):  # eight lanes: the backlog builds within a few steps
        await ws.send(create(stream_id=f"l{lane}", max_output_tokens=2000))
    # held, not looked up later: the front drops a connection from server.connections as
    # soon as it has sent its close frame (the 16 first events of 8 lanes, queued at once,
    # can be over 2048 bytes already; then that is within milliseconds)
    await wait_until(lambda: server.connections, 30, "the connection")
    conn = next(iter(server.connections))
    await wait_until(lambda: conn.outbox.overflowed and not conn.runs, 300,
                     "the slow reader's outbox to overflow")
    try:
        while True:  # what was buffered, then the close frame
            await ws.recv()
    except ConnectionClosed as exc:
        assert exc.rcvd is not None and exc.rcvd.code == 1008
    await wait_idle(engine)
    assert engine.scheduler.pool.usage == 0.0
