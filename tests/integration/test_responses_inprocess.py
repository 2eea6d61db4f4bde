"""`/v1/responses` on an in-process server (real model) where the test needs the engine."""

from __future__ import annotations

import json

import pytest
import websockets
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from service.config import ServerConfig

from tests.integration.reliability_support import wait_idle

pytestmark = pytest.mark.model

EVENT = TypeAdapter(ResponsesServerEvent)


async def test_an_unset_max_output_tokens_fits_a_kv_cache_smaller_than_the_context(
        make_server) -> None:
    engine, server = await make_server(ServerConfig(port=0), num_kv_blocks=32)  # 512 tokens
    assert engine.max_model_len > 512
    url = server.url.replace("/v1/stream", "/v1/responses")
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "response.create", "temperature": 0,
                                  "input": "What is the capital of France?"}))
        while (event := EVENT.validate_json(await ws.recv())).type not in (
                "response.completed", "response.incomplete", "response.failed", "error"):
            pass
    assert event.type == "response.completed", event
    assert "Paris" in event.response.output[0].content[0].text
    await wait_idle(engine)


async def _final_event(ws, **create) -> object:
    await ws.send(json.dumps({"type": "response.create", **create}))
    while (event := EVENT.validate_json(await ws.recv())).type not in (
            "response.completed", "response.incomplete", "response.failed", "error"):
        pass
    return event


async def test_context_errors_name_the_responses_fields(make_server) -> None:
    engine, server = await make_server(ServerConfig(port=0), num_kv_blocks=32)  # 512 tokens
    url = server.url.replace("/v1/stream", "/v1/responses")
    long_input = "one two three four five six seven eight nine ten " * 80  # > 512 tokens
    async with websockets.connect(url) as ws:
        event = await _final_event(ws, input=long_input)
        assert event.type == "error" and event.error.code == "context_length_exceeded", event
        assert event.error.param == "input"
        assert "leaves no room for output" in event.error.message, event.error.message
        assert "max_tokens" not in event.error.message
        event = await _final_event(ws, input=long_input, max_output_tokens=5)
        assert event.type == "error" and event.error.param == "input", event  # input alone
        event = await _final_event(ws, input="Hi", max_output_tokens=600)
        assert event.type == "error" and event.error.param == "max_output_tokens", event
        assert "max_output_tokens (600)" in event.error.message, event.error.message
        # a frame refused while it is read still answers on its lane
        event = await _final_event(ws, input="Hi", metadata={"k": 1}, stream_id="lane-D")
        assert event.type == "error" and event.error.param.startswith("metadata"), event
        assert json.loads(event.model_dump_json())["stream_id"] == "lane-D", event
        ok = await _final_event(ws, input="Say hi.", max_output_tokens=4, temperature=0)
        assert ok.type in ("response.completed", "response.incomplete"), ok  # still serving
    await wait_idle(engine)
