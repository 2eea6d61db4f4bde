"""The Responses API over plain HTTP (`POST /v1/responses`) and function tools on both of
its transports, against the real server and model, through the official `openai` SDK:
`responses.create` (streamed and not), `responses.stream`, `previous_response_id`,
`text.format`, tools with every tool_choice, call items fed back as input, and bad input
refused with a code while the server goes on serving.

Every streamed event is validated as the SDK's `ResponseStreamEvent` (pydantic)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from service.config import ServerConfig
from tests.integration.openai_server import ThreadedServer

pytestmark = pytest.mark.model

KEY = "resp-http-key-5"
MODEL = "SmolLM2-135M-Instruct"
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["C", "F"]}},
               "required": ["city", "unit"]}, "strict": True}
SEARCH = {"type": "function", "name": "search", "description": "Search the web",
          "parameters": {"type": "object", "properties": {"query": {"type": "string",
                                                                    "maxLength": 40}},
                         "required": ["query"]}}
ASK_WEATHER = "What is the weather in Paris? Use the tool."


@pytest.fixture(scope="module")
def server(served_model):
    s = ThreadedServer(served_model, ServerConfig(port=0, api_key=KEY, max_message_bytes=64_000),
                       max_num_seqs=8).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)


def post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.base_url + "/responses", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"}, **kw)


def test_create_returns_one_response_object(server, client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                temperature=0, max_output_tokens=24,
                                instructions="Answer in one sentence.")
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert "Paris" in r.output_text and r.output[0].type == "message"
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.store is True
    # the raw body validates as the SDK's Response (strict pydantic, not the SDK's lenient
    # construction), also with tools in it
    raw = post(server, {"input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 60,
                        "tool_choice": "required", "temperature": 0})
    body = SdkResponse.model_validate(raw.json())
    assert body.output[0].type == "function_call" and body.tools[0].name == "get_weather"


def test_stream_true_sends_the_websocket_modes_events(client):
    stream = client.responses.create(model=MODEL, input="Name a primary color.", temperature=0,
                                     max_output_tokens=16, stream=True)
    events = list(stream)
    for e in events:
        STREAM_EVENT.validate_python(e.model_dump())
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output[0].content[0].text == text


def test_responses_stream_helper_and_previous_response_id(client):
    with client.responses.stream(model=MODEL, input="My name is Ada. Say hello to me.",
                                 instructions="Answer in a few words.", temperature=0,
                                 max_output_tokens=64) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        first = stream.get_final_response()
    assert "".join(deltas) == first.output_text
    # the next turn continues the first one's exact tokens: its full blocks hit the cache
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     instructions="Answer in a few words.",
                                     max_output_tokens=12, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # store: false keeps nothing to continue over HTTP
    third = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=third.id)
    assert info.value.code == "previous_response_not_found"


def test_retrieve_and_delete_a_stored_response(server, client):
    """GET /v1/responses/{id} gives the response as served, DELETE forgets it; an id not
    kept (deleted, store=false, unknown) is a 404, and a deleted one cannot be continued."""
    first = client.responses.create(model=MODEL, input="Name a color.", temperature=0,
                                    max_output_tokens=8)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    streamed = client.responses.create(model=MODEL, input="Name a fruit.", stream=True,
                                       max_output_tokens=8)
    final = [e for e in streamed
             if e.type in ("response.completed", "response.incomplete")][0].response
    assert client.responses.retrieve(final.id).output_text == final.output_text
    r = httpx.get(server.base_url + f"/responses/{first.id}?stream=true",
                  headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert httpx.get(server.base_url + f"/responses/{first.id}").status_code == 401  # no key
    r = httpx.delete(server.base_url + f"/responses/{first.id}",
                     headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "response",
                                                 "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:  # as OpenAI answers it
        client.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                max_output_tokens=4)
    assert e.value.code == "previous_response_not_found"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(final.id)  # the SDK's delete: a 200 it reads as None


def test_text_format_json_schema_over_http(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="Describe Paris.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_tools_required_and_named_give_function_call_items(client):
    r = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER, SEARCH],
                                tool_choice="required", temperature=0, max_output_tokens=80)
    [call] = _calls(r)
    assert r.status == "completed" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.name in ("get_weather", "search")
    args = json.loads(call.arguments)
    jsonschema.validate(args, (WEATHER if call.name == "get_weather" else SEARCH)["parameters"])
    # a named function: exactly that call, streamed as OpenAI's argument events
    stream = client.responses.create(model=MODEL, input="Find news about cats.",
                                     tools=[WEATHER, SEARCH], temperature=0,
                                     tool_choice={"type": "function", "name": "search"},
                                     max_output_tokens=80, stream=True)
    events = list(stream)
    for e in events:
        STREAM_EVENT.validate_python(e.model_dump())
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in types
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    [call] = _calls(events[-1].response)
    assert call.name == "search" and call.arguments == events[-3].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
        == call.arguments
    json.loads(call.arguments)


def test_a_call_and_its_output_fed_back_get_an_answer(client):
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=80)
    [call] = _calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature": 18, "unit": "C"})}
    # chained: only the output is new; the tools stay, tool_choice "none" lets it answer
    answer = client.responses.create(model=MODEL, input=[result], tools=[WEATHER],
                                     previous_response_id=first.id, temperature=0,
                                     max_output_tokens=30)
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    assert answer.usage.input_tokens_details.cached_tokens >= 16
    # the whole history sent back as items (no previous_response_id)
    items = [{"role": "user", "content": ASK_WEATHER},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, result]
    again = client.responses.create(model=MODEL, input=items, tools=[WEATHER],
                                    tool_choice="none", temperature=0, max_output_tokens=30)
    assert again.output[0].type == "message" and again.output_text
    assert again.tool_choice == "none"


def test_tools_over_the_websocket_mode(server):
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        async with client.responses.connect() as conn:
            await conn.response.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER],
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=80)
            events = []
            async for event in conn:
                events.append(event)
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
            # a bad tool_choice is an error event, and the socket goes on
            await conn.response.create(model=MODEL, input="x", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "nope"})
            events.append(await asyncio.wait_for(conn.recv(), 60))
            return events
    events = asyncio.run(main())
    done, error = events[-2], events[-1]
    assert done.type == "response.completed", done
    [call] = _calls(done.response)
    assert call.name == "get_weather" and json.loads(call.arguments)["unit"] in ("C", "F")
    assert error.type == "error" and error.error.code == "invalid_value"
    assert error.error.param == "tool_choice.name"


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "invalid_value", "tool_choice.name"),
    ({"input": "x", "tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "unsupported_value",
     "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": False}}},
     400, "invalid_value", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, 400, "invalid_value", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "string", "pattern": "(unclosed"}}}}, 400, "invalid_value", "text.format"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[z-a]"}}}}]},
     400, "invalid_value", "tools"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, 400, "invalid_value", "tools"),
    ({"input": "x", "model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_not_found",
     "previous_response_id"),
    ({"input": "x", "stream_id": "lane"}, 400, "unsupported_parameter", "stream_id"),
    ({"input": "x", "max_output_tokens": 2**31 - 1}, 400, "context_length_exceeded",
     "max_output_tokens"),
    ({"input": "x", "colour": 1}, 400, "unknown_parameter", "colour"),
])
def test_bad_input_is_a_4xx_with_its_code(server, body, status, code, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), r.text


def test_bodies_too_deep_or_too_big_and_the_server_goes_on(server):
    deep = b'{"input": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}",
                                           "Content-Type": "application/json"}) as http:
        r = http.post(server.base_url + "/responses", content=deep)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        # a huge schema: over the body limit (413) ...
        huge = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                 for i in range(5000)}}
        r = http.post(server.base_url + "/responses", content=json.dumps(
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "h",
                                               "schema": huge}}}))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = http.post(server.base_url + "/responses", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = http.post(server.base_url + "/responses", content=b"{}",
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        # ... and the same keep-alive connection serves the next request
        r = http.post(server.base_url + "/responses", content=json.dumps(
            {"input": "Say hi.", "max_output_tokens": 4}))
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")


def test_bad_input_over_the_websocket_mode_is_an_error_event_and_the_socket_goes_on(server):
    url = server.base_url.replace("http://", "ws://") + f"/responses?api_key={KEY}"

    def create(**fields) -> str:
        return json.dumps({"type": "response.create", "model": MODEL, "input": "x", **fields})

    frames = [
        ('{"type": "response.create", "input": "x", "metadata": ' + "[" * 5000 + "]" * 5000
         + "}", "invalid_json", None),
        (create(text={"format": {"type": "json_schema", "name": "n", "schema": False}}),
         "invalid_value", "text.format"),
        (create(text={"format": {"type": "json_schema", "name": "n", "schema": {
            "type": "string", "pattern": "(unclosed"}}}), "invalid_value", "text.format"),
        (create(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
         "invalid_value", "tool_choice.name"),
        (create(tools=[WEATHER, WEATHER]), "invalid_value", "tools"),
        (create(tools=[{"type": "file_search"}]), "unsupported_value", "tools[0].type"),
    ]

    async def main() -> tuple[list, list]:
        import websockets

        errors = []
        async with websockets.connect(url, max_size=None) as ws:
            for frame, _, _ in frames:
                await ws.send(frame)
                errors.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            await ws.send(create(input="Say hi.", max_output_tokens=4))
            events = []
            while not events or events[-1]["type"] not in ("response.completed",
                                                            "response.incomplete"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
        return errors, events

    errors, events = asyncio.run(main())
    for error, (_, code, param) in zip(errors, frames):
        assert error["type"] == "error" and error["status"] == 400, error
        assert (error["error"]["code"], error["error"]["param"]) == (code, param), error
    assert events[0]["type"] == "response.created"


def test_a_client_leaving_a_stream_cancels_its_response(server):
    import time

    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", server.base_url + "/responses", json={
                "input": "Count from 1 to 500.", "max_output_tokens": 1500, "stream": True,
                "temperature": 0}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data:") and "output_text.delta" in line:
                    break
    # 1,500 tokens would take far longer than this: the engine cancelled it
    deadline = time.monotonic() + 8
    while server.idle() != (0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.idle() == (0, 0.0)
