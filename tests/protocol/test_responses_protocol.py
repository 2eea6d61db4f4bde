"""`response.create` parsing and the Responses events, checked against the official SDK's types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses.responses_client_event import ResponseCreate as SdkCreate
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from protocol import ChatMessage, encode
from protocol.responses_request import ResponsesError, parse_client_frame, parse_create_body
from protocol.structured import FunctionName, ToolChoiceFunction

SERVER_EVENT = TypeAdapter(ResponsesServerEvent)


def create(**fields) -> str:
    return json.dumps({"type": "response.create", **fields})


def test_string_input_is_one_user_turn() -> None:
    req = parse_client_frame(create(model="m", input="Hi", max_output_tokens=5, temperature=0))
    assert req.messages == [ChatMessage("user", "Hi")]
    assert (req.model, req.max_output_tokens, req.temperature, req.top_p) == ("m", 5, 0.0, None)
    assert (req.store, req.generate, req.metadata, req.stream_id) == (True, True, {}, None)


def test_message_items_and_parts_become_chat_turns() -> None:
    req = parse_client_frame(create(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "you"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
    ], store=False, generate=False, metadata={"k": "v"}, stream_id="lane-1"))
    assert req.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello, you"),
                            ChatMessage("assistant", "Hi!")]
    assert (req.store, req.generate, req.metadata, req.stream_id) == (False, False, {"k": "v"},
                                                                      "lane-1")


def test_what_the_agents_sdk_sends_with_no_tools_is_accepted() -> None:
    req = parse_client_frame(create(
        model="m", input=[{"role": "user", "content": "Hi"}], include=[], tools=[],
        stream=True, instructions="You are terse.", text={"format": {"type": "text"}},
        tool_choice="auto", parallel_tool_calls=False, truncation="disabled",
        reasoning={"effort": None, "summary": None}))
    assert req.instructions == "You are terse." and req.messages == [ChatMessage("user", "Hi")]


@pytest.mark.parametrize("fields, code, param", [
    ({"tools": [{"type": "web_search"}]}, "unsupported_value", "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "invalid_value", "tools[0].name"),
    ({"tools": {"type": "function", "name": "f"}}, "invalid_type", "tools"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "invalid_value",
     "tools"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({"tool_choice": "sometimes"}, "invalid_value", "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "invalid_value", "tool_choice.name"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "unsupported_value",
     "tool_choice.type"),
    ({"parallel_tool_calls": "yes"}, "invalid_value", "parallel_tool_calls"),
    ({"text": {"format": {"type": "xml"}}}, "unsupported_value", "text.format"),
    ({"reasoning": {"effort": "high"}}, "unsupported_parameter", "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "unsupported_parameter", "include"),
    ({"background": True}, "unsupported_parameter", "background"),
    ({"conversation": "conv_1"}, "unsupported_parameter", "conversation"),
    ({"truncation": "auto"}, "unsupported_value", "truncation"),
    ({"colour": "blue"}, "unknown_parameter", "colour"),
    ({"temperature": 2.5}, "invalid_value", "temperature"),
    ({"top_p": 0}, "invalid_value", "top_p"),
    ({"max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "unsupported_value", "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "invalid_value",
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "invalid_type", "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "x"}]}]}, "invalid_value",
     "input[0].output[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "unsupported_value", "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, "bare"]}]},
     "invalid_type", "input[0].content[1]"),
    ({"input": []}, "missing_required_parameter", "input"),
])
def test_bad_or_unsupported_fields_are_named(fields, code, param) -> None:
    body = {"input": "Hi", **fields}
    with pytest.raises(ResponsesError) as info:
        parse_client_frame(create(**body))
    assert (info.value.code, info.value.param, info.value.status) == (code, param, 400)
    SERVER_EVENT.validate_json(encode(info.value.event(0)))  # the documented error shape
    assert info.value.stream_id is None
    with pytest.raises(ResponsesError) as on_lane:  # the same refusal on a lane answers there
        parse_client_frame(create(**body, stream_id="lane-7"))
    assert (on_lane.value.code, on_lane.value.stream_id) == (code, "lane-7")


@pytest.mark.parametrize("frame, code", [
    ("{not json", "invalid_json"),
    ('{"type": "response.steer", "input": "x"}', "unsupported_value"),
    ('{"type": "generate", "id": "r1", "prompt": "x"}', "invalid_value"),
    ("[1, 2]", "invalid_json"),
])
def test_frames_that_are_not_a_create(frame, code) -> None:
    with pytest.raises(ResponsesError) as info:
        parse_client_frame(frame)
    assert info.value.code == code
    event = json.loads(encode(info.value.event(0)))
    assert event["type"] == "error" and event["sequence_number"] == 0
    assert set(event["error"]) == {"type", "code", "message", "param"}


def test_the_sdk_create_event_parses() -> None:
    """What `connection.response.create(...)` sends: the SDK's own model, serialized."""
    sdk = SdkCreate(type="response.create", model="m", input="Hi", previous_response_id="r",
                    max_output_tokens=8, top_p=0.5, generate=True, stream_id="s")
    req = parse_client_frame(sdk.to_json(exclude_unset=True))
    assert (req.previous_response_id, req.max_output_tokens, req.top_p, req.stream_id) == \
        ("r", 8, 0.5, "s")


def test_text_format_becomes_the_engines_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_client_frame(create(model="m", input="Hi", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}))
    assert req.response_format == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}
    req = parse_client_frame(create(model="m", input="Hi", text={"format": {"type": "json_object"}}))
    assert req.response_format == {"type": "json_object"}
    assert parse_client_frame(create(model="m", input="Hi")).response_format is None


def test_function_tools_and_call_items_become_the_chat_shapes() -> None:
    req = parse_client_frame(create(
        model="m", parallel_tool_calls=True,
        tools=[{"type": "function", "name": "get_weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "message", "role": "assistant", "content": "Let me look."},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city":"Paris"}', "id": "fc_1", "status": "completed"},
               {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                "arguments": '{"city":"Lyon"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
               {"type": "function_call_output", "call_id": "call_2",
                "output": [{"type": "input_text", "text": "20 C"}]}]))
    [tool] = req.tools
    assert (tool.function.name, tool.function.description, tool.function.strict) == \
        ("get_weather", "Weather now", True)
    assert req.tool_choice == ToolChoiceFunction(function=FunctionName("get_weather"))
    assert req.parallel_tool_calls is True
    user, assistant, first, second = req.messages
    assert assistant.role == "assistant" and assistant.content == "Let me look."
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'), ("call_2", "get_weather", '{"city":"Lyon"}')]
    assert first == ChatMessage("tool", "18 C", tool_call_id="call_1", name="get_weather")
    assert second == ChatMessage("tool", "20 C", tool_call_id="call_2", name="get_weather")


def test_tool_choice_none_and_auto_and_defaults() -> None:
    tools = [{"type": "function", "name": "f"}]
    assert parse_client_frame(create(input="x", tools=tools)).tool_choice is None
    assert parse_client_frame(create(input="x", tools=tools, tool_choice="none")).tool_choice \
        == "none"
    req = parse_client_frame(create(input="x", tools=tools, tool_choice="required"))
    assert req.tool_choice == "required" and req.parallel_tool_calls is False


def test_the_http_body_parses_without_a_type() -> None:
    req = parse_create_body({"model": "m", "input": "Hi", "stream": True})
    assert req.stream is True and req.messages == [ChatMessage("user", "Hi")]
    assert parse_create_body({"input": "Hi"}).stream is False
    with pytest.raises(ResponsesError) as info:
        parse_create_body({"input": "Hi", "stream_id": "lane"})
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "stream_id")
    with pytest.raises(ResponsesError) as info:
        parse_create_body([1, 2])
    assert info.value.code == "invalid_type" and info.value.status == 400
