"""The OpenAI HTTP API on the real server and model, through the official `openai` SDK,
LangChain's ChatOpenAI (an independent client) and raw HTTP: streamed and not, usage,
n, echo, errors naming their field, auth, and a mid-stream disconnect."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from service.config import ServerConfig
from tests.integration.openai_server import ThreadedServer

pytestmark = pytest.mark.model

KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(loaded_model):
    s = ThreadedServer(loaded_model, ServerConfig(port=0, api_key=KEY, max_message_bytes=64_000),
                       max_num_seqs=8).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)


def wait_idle(server: ThreadedServer, seconds: float = 30) -> tuple[int, float]:
    deadline = time.monotonic() + seconds
    state = server.idle()
    while state != (0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.05)
        state = server.idle()
    return state


def test_sdk_streams_chat_with_usage(server, client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 24 and usage.prompt_tokens > 10
    # the same request not streamed: the same greedy text
    whole = client.chat.completions.create(messages=QUESTION, max_completion_tokens=24,
                                           temperature=0, model="SmolLM2-135M-Instruct")
    assert whole.choices[0].message.content == text
    assert whole.usage.completion_tokens == usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache served it


def test_sdk_completions_with_usage_n_and_echo(server, client):
    out = client.completions.create(model="SmolLM2-135M-Instruct",
                                    prompt=["The capital of France is", "One, two, three,"],
                                    max_tokens=6, temperature=0.8, seed=7, n=2)
    assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage.completion_tokens <= 24 and out.usage.prompt_tokens > 0
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello there",
                                       max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Hello there")
    ids = server.call(lambda: server.engine.tokenizer.encode("Once upon a time"))
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids,
                                         max_tokens=5, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "top_k": 5})
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts if p.choices)
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_langchain_chat_openai_invoke_and_stream(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key=KEY, model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=24, max_retries=0, timeout=300)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    pieces = [c.content for c in llm.stream("What is the capital of France?")]
    assert "Paris" in "".join(pieces) and len([p for p in pieces if p]) > 1


def test_sdk_chat_logprobs_streamed_and_whole(server, client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12, temperature=0,
              logprobs=True, top_logprobs=3)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    whole = client.chat.completions.create(**kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == len(streamed) > 0
    for a, b in zip(streamed, entries):  # the second hits the prefix cache: other row
        assert a.token == b.token             # buckets, so float rounding may differ
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    text = whole.choices[0].message.content
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.token == e.top_logprobs[0].token  # greedy: the most likely token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert bytes(e.bytes).decode() == e.token
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION,
                                           max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_sdk_completion_echo_logprobs_as_lm_eval_asks(server, client):
    # lm-eval's loglikelihood request: context + continuation, echo, logprobs=1, 1 token
    context, continuation = "The capital of France is", " Paris"
    ids = server.call(lambda: server.engine.tokenizer.encode(context + continuation))
    n_ctx = len(server.call(lambda: server.engine.tokenizer.encode(context)))
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1,
                                    temperature=0, logprobs=1, echo=True, seed=1234)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(value)  # the chosen token is always in the map
        assert max(top.values()) >= value
    # what lm-eval computes: the continuation's loglikelihood and whether it is greedy
    continuation_lp = sum(lp.token_logprobs[n_ctx:-1])
    assert -20 < continuation_lp < 0
    # the same distribution through the sampling path: the generated token's own score
    # equals its score as the next token of a prompt without echo
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1,
                                      temperature=0, logprobs=2)
    p = plain.choices[0].logprobs
    assert p.tokens == lp.tokens[-1:]
    assert p.token_logprobs[0] == pytest.approx(lp.token_logprobs[-1], abs=1e-4)
    assert len(p.top_logprobs[0]) == 2  # the greedy token is one of the top 2
    # streamed: the echo chunk carries the prompt's scores, then each token its own
    chunks = [c for c in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=context, max_tokens=3, temperature=0,
        logprobs=0, echo=True, stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert chunks[0].choices[0].text == context
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert len(chunks[0].choices[0].logprobs.tokens) == n_ctx
    scored = [c.choices[0].logprobs for c in chunks[1:] if c.choices[0].logprobs]
    assert sum(len(s.tokens) for s in scored) == 3
    offsets = [o for s in [chunks[0].choices[0].logprobs] + scored for o in s.text_offset]
    assert offsets == sorted(offsets)


def test_langchain_chat_openai_logprobs(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key=KEY, model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=8, max_retries=0, timeout=300,
                     logprobs=True, top_logprobs=2)
    answer = llm.invoke("What is the capital of France?")
    content = answer.response_metadata["logprobs"]["content"]
    assert len(content) == answer.usage_metadata["output_tokens"] > 0
    assert "".join(e["token"] for e in content) == answer.content
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_lm_eval_local_completions_loglikelihood_matches_the_oracle(server, hf_model,
                                                                   tmp_path):
    # lm-eval's own client (the `local-completions` model): echo + logprobs=1, max_tokens 1
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tok = server.engine.tokenizer
    tok.save_pretrained(tmp_path)  # lm-eval tokenizes itself, with the served tokenizer
    lm = LocalCompletionsAPI(model="SmolLM2-135M-Instruct", base_url=server.base_url +
                             "/completions", tokenizer=str(tmp_path),
                             tokenizer_backend="huggingface", tokenized_requests=True,
                             num_concurrent=2, max_retries=1,
                             header={"Authorization": f"Bearer {KEY}"})
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
             ("Once upon a", " time there was a princess")]
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
                            for i, p in enumerate(pairs)])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        c, w = tok.encode(ctx), tok.encode(ctx + cont)
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(torch.tensor([w])).logits[0].float(), -1)
        ref = sum(lp[p - 1, w[p]].item() for p in range(len(c), len(w)))
        # auto may multiply by int16 activations (logits within 3e-2): a loose bound
        assert ll == pytest.approx(ref, abs=0.05), (ctx, cont)
        assert greedy == all(lp[p - 1].argmax().item() == w[p] for p in range(len(c), len(w)))
    assert got[0][1] and not got[1][1]  # " Paris" is the greedy answer, " Berlin" is not


BAD = [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"), ({"seed": 2**64}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": ["a"] * 9}, "stop"), ({"n": 0}, "n"), ({"n": 99}, "n"),
    ({"user": 5}, "user"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"priority": 1.5}, "priority"),
    ({"logprobs": "yes"}, "logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"a": 2}}, "logit_bias"),
    ({"logit_bias": {"1": 200}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]},
                                     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "t1"}]},
     "messages[0].tool_call_id"),  # only a tool message answers a call
    ({"messages": [*QUESTION, {"role": "tool", "content": "42", "tool_call_id": 7}]},
     "messages[1].tool_call_id"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": None,
                               "tool_calls": [{"id": "t1", "type": "function"}]}]},
     "messages[1].tool_calls[0]"),
]


def test_sdk_lists_and_retrieves_the_model(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    card = client.models.retrieve("SmolLM2-135M-Instruct")
    assert (card.id, card.object, card.owned_by) == ("SmolLM2-135M-Instruct", "model", "conveyor")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")  # a name with a slash reaches the route too
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(server.base_url + "/models/SmolLM2-135M-Instruct")  # no key: 401
    assert r.status_code == 401


def test_cors_preflight_with_every_origin_allowed(server):
    r = httpx.options(server.base_url + "/chat/completions", headers={
        "Origin": "http://any.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers


def test_tool_message_with_its_call_id_is_served_as_the_tool_turn(client):
    """The openai SDK's typed tool message carries tool_call_id; the chat template renders
    the content alone, so the prompt is the one without the id."""
    turns = [*QUESTION, {"role": "tool", "content": "The tool says: Paris."}]
    plain = client.chat.completions.create(messages=turns, max_tokens=8, temperature=0,
                                           model="SmolLM2-135M-Instruct")
    with_id = client.chat.completions.create(
        messages=[*QUESTION, {**turns[1], "tool_call_id": "call_1"}], max_tokens=8,
        temperature=0, model="SmolLM2-135M-Instruct")
    assert with_id.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_id.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_chat_field_is_400_naming_it(server, extra, param):
    body = {"messages": QUESTION, "max_tokens": 4, **extra}
    r = httpx.post(server.base_url + "/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and \
        error["message"]
    # the field as the client named it, never the WebSocket protocol's path
    assert error["code"] and "$." not in error["message"], error


def test_bad_completion_fields_and_http_errors(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = server.base_url
    for extra, param in [({"prompt": 5}, "prompt"), ({"prompt": [[1, 2], "a"]}, "prompt"),
                         ({"prompt": [10**9]}, "prompt[0]"), ({"echo": "x"}, "echo"),
                         ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
                         ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                         ({"logprobs": True}, "logprobs"), ({"logprobs": "2"}, "logprobs"),
                         ({"logprobs": 21, "echo": True}, "logprobs")]:
        r = httpx.post(url + "/completions", json={"prompt": "hi", **extra}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(url + "/chat/completions", json={"messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.post(url + "/chat/completions", json={"messages": QUESTION, "model": "gpt-9"},
                   headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/chat/completions", headers=auth,
                   json={"messages": [{"role": "user", "content": "x" * 70_000}]})
    assert r.status_code == 413 and r.json()["error"]["param"] is None
    r = httpx.post(url + "/chat/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/nope", headers=auth, json={})  # OpenAI's body for routing errors too
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/responses", headers=auth, json={"input": "hi", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.get(url + "/chat/completions", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]
    r = httpx.post(url + "/chat/completions", headers=auth,
                   json={"messages": QUESTION, "max_tokens": 2**31 - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # a prompt over the context by itself is named as the prompt's field, as OpenAI does
    long = "hello " * 9000  # about 9,000 tokens, over the 8,192 context
    for route, body, param in [("/chat/completions", {"messages": [
            {"role": "user", "content": long}]}, "messages"),
            ("/completions", {"prompt": long}, "prompt")]:
        r = httpx.post(url + route, headers=auth, json={**body, "max_tokens": 5})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
        assert error["param"] == param, r.text
    assert "at least 0 tokens" not in r.json()["error"]["message"], r.text
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics", headers=auth).text
    assert 'conveyor:http_requests_total{model_name="SmolLM2-135M-Instruct",' \
           'route="/v1/chat/completions",status="400"}' in metrics


def test_mid_stream_disconnect_aborts_and_frees_the_kv_cache(server):
    body = json.dumps({"messages": QUESTION, "max_tokens": 2000, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=120)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    received = b""
    while received.count(b'"content":"') < 5:  # a few content chunks: it is running
        data = sock.recv(65536)
        assert data, received
        received += data
    assert received.startswith(b"HTTP/1.1 200")
    running, usage = server.idle()
    assert running == 1 and usage > 0
    sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    sock.close()
    assert wait_idle(server) == (0, 0.0)
