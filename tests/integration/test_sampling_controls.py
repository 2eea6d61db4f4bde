"""Issue 48 items 3 and 4 on the real server and model: the sampling controls (penalties,
logit_bias, min_tokens, repetition_penalty) through the openai SDK and the WebSocket
protocol; prompt_logprobs, return_token_ids, chat echo / continue_final_message,
continuous usage, the default max_tokens, and bad input (vocabulary, media type, depth)."""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest

from protocol.client import connect
from protocol.messages import Delta, Done
from service.config import ServerConfig
from tests.integration.openai_server import ThreadedServer

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REPEAT = "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,"


@pytest.fixture(scope="module")
def server(loaded_model):
    s = ThreadedServer(loaded_model, ServerConfig(port=0), max_num_seqs=8).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def completion_ids(client, prompt: str, n: int = 16, **extra) -> list[int]:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"return_token_ids": True, **extra})
    return out.choices[0].model_extra["token_ids"]


def test_logit_bias_forces_a_token_on_chat_and_completions(server, client):
    token = server.call(lambda: server.engine.tokenizer.encode(" banana"))[0]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                          temperature=0, logit_bias={str(token): 100},
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [token] * 4
    assert chat.choices[0].message.content == " banana" * 4
    assert chat.model_extra["prompt_token_ids"][-1] != token  # the prompt, at the top level
    assert completion_ids(client, "Hello", 3, logit_bias={str(token): 100}) == [token] * 3
    # a bias against the greedy answer's first token changes it, and only for that request
    plain = completion_ids(client, "The capital of France is", 4)
    banned = completion_ids(client, "The capital of France is", 4,
                            logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]


def test_penalties_break_a_repetition(client):
    plain = completion_ids(client, REPEAT)
    one = Counter(plain).most_common(1)[0][1]
    assert one >= 6, plain  # greedy keeps counting ones
    for extra in ({"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        penalised = completion_ids(client, REPEAT, **extra)
        assert penalised != plain, extra
        assert Counter(penalised).most_common(1)[0][1] < one, (extra, penalised)
    # presence subtracts once (2 at most): not enough against this run of ones, but it
    # moves an ordinary greedy story, which repeats words
    story = "Once upon a time, in a small village by the sea, there lived"
    plain_story = completion_ids(client, story, 32)
    assert completion_ids(client, story, 32, presence_penalty=2.0) != plain_story
    # neutral values are the plain greedy answer, token for token
    assert completion_ids(client, REPEAT, frequency_penalty=0.0, presence_penalty=0.0,
                          repetition_penalty=1.0) == plain


def test_min_tokens_holds_off_eos(client):
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64,
                                           temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    held = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64,
                                          temperature=0, extra_body={"min_tokens": n + 8})
    assert held.usage.completion_tokens >= n + 8
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


async def test_the_websocket_protocol_serves_the_controls(server):
    token = server.call(lambda: server.engine.tokenizer.encode(" banana"))[0]
    url = server.base_url.replace("http://", "ws://").removesuffix("/v1") + "/v1/stream"
    async with await connect(url) as ws:
        ids: list[int] = []
        async for event in ws.generate(prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={token: 100.0}, presence_penalty=0.5):
            if isinstance(event, Delta):
                ids += event.token_ids
            else:
                assert isinstance(event, Done)
        assert ids == [token] * 3
        done = None
        async for event in ws.generate(messages=QUESTION, max_tokens=40, temperature=0,
                                       min_tokens=30):
            done = event
        assert done.usage.completion_tokens >= 30


def test_prompt_logprobs_and_token_ids_over_http(server, client):
    prompt = "The capital of France is"
    ids = server.call(lambda: server.engine.tokenizer.encode(prompt))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == out.usage.completion_tokens
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    for token_id, entry in zip(ids[1:], lps[1:]):
        assert str(token_id) in entry and len(entry) in (2, 3)
        assert all(e["logprob"] <= 0 and e["decoded_token"] is not None for e in entry.values())
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"] in (1, 2))
        assert [r for r, _ in ranked][:1] == [1]
    # the same numbers as the legacy echo + logprobs path
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       echo=True, logprobs=2)
    legacy = echoed.choices[0].logprobs.token_logprobs[1:len(ids)]
    assert [lps[i][str(ids[i])]["logprob"] for i in range(1, len(ids))] == \
        pytest.approx(legacy, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_chat_echo_and_continue_final_message(client):
    start = "The capital of France is"
    out = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "content": start}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    text = out.choices[0].message.content
    assert text.startswith(start) and "Paris" in text, text
    streamed = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, stream=True,
        messages=[*QUESTION, {"role": "assistant", "content": start}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # echo of a conversation that ends with the user's turn adds nothing
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                           temperature=0, extra_body={"echo": True})
    assert not plain.choices[0].message.content.startswith(QUESTION[0]["content"])


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and chunks[-1].choices == []
    assert chunks[-2].usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_bad_input_is_refused_naming_the_field(server):
    url = server.base_url
    vocab = server.call(lambda: server.engine.runner.vocab_size)
    cases = [
        ("/completions", {"prompt": "hi", "stop_token_ids": [vocab]}, "stop_token_ids[0]"),
        ("/completions", {"prompt": "hi", "logit_bias": {str(vocab + 5): 1}}, "logit_bias"),
        ("/completions", {"prompt": "hi", "logit_bias": {"x1": 1}}, "logit_bias"),
        ("/completions", {"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
        ("/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ("/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        ("/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ("/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
        ("/chat/completions", {"messages": QUESTION, "continue_final_message": True,
                               "add_generation_prompt": True}, "continue_final_message"),
        ("/chat/completions", {"messages": QUESTION, "stream": True,
                               "stream_options": {"continuous_usage_stats": "yes"}},
         "stream_options.continuous_usage_stats"),
    ]
    for route, body, param in cases:
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    # the messages say what is wrong: the vocabulary's size, every bad logit_bias key
    for body, words in (({"prompt": "hi", "stop_token_ids": [vocab + 1]}, [str(vocab + 1), str(vocab)]),
                        ({"prompt": "hi", "logit_bias": {str(vocab + 1): 1}}, [str(vocab + 1), str(vocab)]),
                        ({"prompt": "hi", "logit_bias": {"bad1": 5, "bad2": 1}}, ["bad1", "bad2"])):
        message = httpx.post(url + "/completions", json=body, timeout=60).json()["error"]["message"]
        assert all(w in message for w in words), (body, message)


def test_streamed_chat_token_ids_as_vllm_places_them(client):
    """return_token_ids on a streamed chat: the prompt's ids at the top level of the first
    chunk (the role chunk) and of no other; each content chunk's token_ids, together the
    unstreamed answer's."""
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                           temperature=0, extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    ids = [t for c in chunks[1:] if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert ids == whole.choices[0].model_extra["token_ids"]


def test_media_type_and_nesting(server):
    url = server.base_url + "/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {},
                    {"Content-Type": "text/plain"}):
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert r.json()["error"]["type"] == "invalid_request_error"  # the client's error
    ok = httpx.post(url, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with httpx.Client(headers={"Content-Type": "application/json"}, timeout=60) as http:
        for route in ("/chat/completions", "/completions"):
            r = http.post(server.base_url + route, content=deep)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            assert "nested too deeply" in r.json()["error"]["message"]
            # the same keep-alive connection serves the next request
            r = http.post(url, content=body)
            assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def small_server(loaded_model):
    """A server whose whole KV cache holds 640 tokens (the room a request has)."""
    s = ThreadedServer(loaded_model, ServerConfig(port=0), max_num_seqs=2,
                       num_kv_blocks=40).start()
    yield s
    s.stop()


def test_the_default_max_tokens_is_the_room_left(small_server):
    url = small_server.base_url
    ids = [28] * 630
    r = httpx.post(url + "/completions", timeout=300,
                   json={"prompt": ids, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 10
    assert r.json()["choices"][0]["finish_reason"] == "length"
    full = httpx.post(url + "/completions", json={"prompt": [28] * 640}, timeout=60)
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt", full.text
    chat = httpx.post(url + "/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi " * 700}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
    sent = httpx.post(url + "/chat/completions", timeout=60,
                      json={"messages": QUESTION, "max_completion_tokens": 700})
    assert sent.json()["error"]["param"] == "max_completion_tokens", sent.text
