"""ResponseRun: engine events -> Responses events, in the documented order, numbered from 0,
each one valid as the official SDK's `ResponsesServerEvent`; a slow reader's deltas merge
in the outbox without gaps in `sequence_number`; the per-connection store's bounds."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from protocol import ChatMessage, Delta, Done, Error, Timings, Usage, encode
from protocol.responses_request import parse_client_frame
from protocol.structured import FunctionCallDelta, ToolCallDelta
from service.front.ws.outbox import Outbox
from service.front.ws.responses.context import context_after
from service.front.ws.responses.run import ResponseRun
from service.front.ws.responses.store import ResponseStore, StoredResponse

SERVER_EVENT = TypeAdapter(ResponsesServerEvent)
TEXT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
              "response.content_part.added"]
CLOSE_ORDER = ["response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


def make_run(frames: list[bytes], **create) -> tuple[ResponseRun, list[Done]]:
    body = {"type": "response.create", "input": "Hi", **create}
    finished: list[Done] = []

    def put(event) -> bool:
        frames.append(encode(event))
        return True

    run = ResponseRun("resp_1", parse_client_frame(json.dumps(body)), "SmolLM2-135M-Instruct",
                      temperature=0.2, top_p=0.9, put=put,
                      on_finish=lambda r, d: finished.append(d))
    return run, finished


def done(reason: str, prompt: int = 10, completion: int = 3, cached: int = 0) -> Done:
    return Done(id="resp_1", finish_reason=reason,  # type: ignore[arg-type]
                usage=Usage(prompt_tokens=prompt, completion_tokens=completion,
                            total_tokens=prompt + completion, cached_tokens=cached),
                timings=Timings())


def parsed(frames: list[bytes]) -> list:
    events = [SERVER_EVENT.validate_json(f) for f in frames]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_completed_text_response() -> None:
    frames: list[bytes] = []
    run, finished = make_run(frames, metadata={"user": "u1"}, stream_id="lane")
    run.start()
    for i, piece in enumerate(["The", " capital", ""]):
        run.on_event(Delta(id="resp_1", index=i, text=piece, token_ids=[100 + i]))
    run.on_event(done("stop", cached=8))
    events = parsed(frames)
    assert [e.type for e in events] == TEXT_ORDER + ["response.output_text.delta"] * 2 + \
        CLOSE_ORDER + ["response.completed"]
    final = events[-1].response
    assert final.status == "completed" and final.output[0].content[0].text == "The capital"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 3
    assert final.usage.total_tokens == 13 and final.usage.input_tokens_details.cached_tokens == 8
    assert final.metadata == {"user": "u1"} and final.temperature == 0.2
    assert all(e.stream_id == "lane" for e in events)
    assert finished and run.output_ids == [100, 101, 102]


def test_the_length_limit_makes_it_incomplete() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames, max_output_tokens=1)
    run.start()
    run.on_event(Delta(id="resp_1", index=0, text="The", token_ids=[1]))
    run.on_event(done("length", completion=1))
    events = parsed(frames)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def piece(index: int, arguments: str, call_id: str | None = None) -> ToolCallDelta:
    name = "get_weather" if call_id is not None else None
    return ToolCallDelta(index=index, id=call_id, type="function" if call_id else None,
                         function=FunctionCallDelta(name=name, arguments=arguments))


def test_function_calls_are_items_with_argument_events() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames, tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    run.start()
    run.on_event(Delta(id="resp_1", index=0, text="", token_ids=[1, 2],
                       tool_calls=[piece(0, '{"city":', "call_a")]))
    run.on_event(Delta(id="resp_1", index=2, text="", token_ids=[3],
                       tool_calls=[piece(0, '"Paris"}')]))
    run.on_event(Delta(id="resp_1", index=3, text="", token_ids=[4],
                       tool_calls=[piece(1, '{"city":"Lyon"}', "call_b")]))
    run.on_event(done("tool_calls", completion=4))
    events = parsed(frames)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.output_index for e in events[2:-1]] == [0] * 5 + [1] * 4
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    final = events[-1].response
    assert final.status == "completed" and final.parallel_tool_calls is True
    assert final.tool_choice == "required" and final.tools[0].name == "get_weather"
    assert [(i.type, i.call_id, i.name, i.arguments, i.status) for i in final.output] == [
        ("function_call", "call_a", "get_weather", '{"city":"Paris"}', "completed"),
        ("function_call", "call_b", "get_weather", '{"city":"Lyon"}', "completed")]
    assert events[5].arguments == '{"city":"Paris"}' and events[5].item_id == final.output[0].id


def test_auto_with_a_plain_answer_opens_the_message_with_its_text() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames, tools=TOOLS)
    run.start()
    assert [json.loads(f)["type"] for f in frames] == ["response.created",
                                                       "response.in_progress"]
    run.on_event(Delta(id="resp_1", index=0, text="Hello", token_ids=[1]))
    run.on_event(done("stop", completion=1))
    events = parsed(frames)
    assert [e.type for e in events] == ["response.created", "response.in_progress"] + \
        TEXT_ORDER[2:] + ["response.output_text.delta"] + CLOSE_ORDER + ["response.completed"]
    assert events[-1].response.output[0].content[0].text == "Hello"


def test_a_call_cut_by_the_length_limit_is_incomplete() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames, tools=TOOLS, tool_choice={"type": "function",
                                                        "name": "get_weather"})
    run.start()
    run.on_event(Delta(id="resp_1", index=0, text="", token_ids=[1],
                       tool_calls=[piece(0, '{"ci', "call_a")]))
    run.on_event(done("length", completion=1))
    events = parsed(frames)
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert final.tool_choice.name == "get_weather"
    [item] = final.output
    assert (item.status, item.arguments) == ("incomplete", '{"ci')


def test_a_warm_up_completes_without_output() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames, generate=False)
    run.start()
    run.on_event(Delta(id="resp_1", index=0, text="x", token_ids=[5]))  # dropped
    run.on_event(done("length", completion=1))
    events = parsed(frames)
    assert [e.type for e in events] == ["response.created", "response.in_progress",
                                        "response.completed"]
    assert events[-1].response.output == [] and events[-1].response.usage.output_tokens == 0
    assert run.output_ids == []


def test_an_engine_failure_is_an_error_event_then_response_failed() -> None:
    frames: list[bytes] = []
    run, _ = make_run(frames)
    run.start()
    run.on_event(Error(id="resp_1", code="internal_error", param=None, message="boom",
                       retryable=False))
    run.on_event(done("error", completion=0))
    events = parsed(frames)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].error.code == "server_error" and events[-2].error.message == "boom"
    assert events[-1].response.error.code == "server_error"


async def test_slow_reader_deltas_merge_and_numbers_stay_contiguous() -> None:
    outbox = Outbox(1 << 20)
    body = {"type": "response.create", "input": "Hi"}
    run = ResponseRun("resp_1", parse_client_frame(json.dumps(body)), "m", temperature=None,
                      top_p=None, put=outbox.put, on_finish=lambda r, d: None)
    run.start()
    for i in range(50):  # the writer is not running yet: the reader is "slow"
        run.on_event(Delta(id="resp_1", index=i, text=f"w{i} ", token_ids=[i]))
    run.on_event(done("stop", completion=50))
    sent: list[bytes] = []

    async def send(data: bytes) -> None:
        sent.append(data)

    writer = asyncio.create_task(outbox.run(send))
    assert await outbox.drain(5.0)
    writer.cancel()
    events = parsed(sent)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 1 and outbox.merged_deltas == 49
    assert deltas[0].delta == "".join(f"w{i} " for i in range(50)) == \
        events[-1].response.output[0].content[0].text
    assert outbox.pending_bytes == 0


def stored(rid: str, n: int) -> StoredResponse:
    return StoredResponse(rid, (ChatMessage("user", "x"),), None, array("i", [1] * n))


def test_store_drops_the_oldest_first_by_count_and_by_tokens() -> None:
    store = ResponseStore(max_responses=2, max_tokens=100)
    for rid in ("a", "b", "c"):
        store.put(stored(rid, 10))
    assert (store.get("a"), len(store), store.num_tokens) == (None, 2, 20)
    store.put(stored("d", 90))  # b goes for the count; c (10) + d (90) fit the tokens
    assert store.get("b") is None and store.get("c") is not None and store.num_tokens == 100
    store.put(stored("e", 5))  # c goes for the count; d + e = 95 tokens
    assert store.get("c") is None and store.num_tokens == 95 and store.evicted == 3
    store.put(stored("f", 20))  # e + f for the tokens: d (the oldest) goes
    assert store.get("d") is None and store.num_tokens == 25
    store.put(stored("huge", 101))  # over the bound alone: kept only as the latest
    assert store.get("huge") is not None and store.num_tokens == 25 and len(store) == 2
    store.put(stored("g", 5))
    assert store.get("huge") is None and store.get("f") is not None


def test_store_false_keeps_only_the_latest() -> None:
    store = ResponseStore(max_responses=8, max_tokens=1000)
    store.put(stored("a", 5), store=False)
    assert store.get("a") is not None and len(store) == 0
    store.put(stored("b", 5), store=True)
    assert store.get("a") is None and store.get("b") is not None
    with pytest.raises(ValueError):
        ResponseStore(0, 10)


def test_store_delete_forgets_a_stored_or_the_latest_response() -> None:
    store = ResponseStore(max_responses=8, max_tokens=1000)
    store.put(stored("a", 5))
    store.put(stored("b", 7))
    assert store.delete("a") and store.get("a") is None and store.num_tokens == 7
    assert store.delete("b") and store.get("b") is None and store.num_tokens == 0
    assert not store.delete("b") and not store.delete("never")
    store.put(stored("c", 5), store=False)
    assert store.delete("c") and store.get("c") is None


def test_context_after_drops_the_trailing_end_of_turn_token() -> None:
    ctx = context_after("r", [1, 2, 3], [7, 8, 2], (ChatMessage("user", "q"),), None,
                        special_ids=frozenset({0, 2}))
    assert list(ctx.token_ids) == [1, 2, 3, 7, 8] and ctx.num_tokens == 5
