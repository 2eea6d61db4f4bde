"""--served-model-name: the one name the API serves the model under, everywhere it shows."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.reliability_support import http_get


async def test_served_model_name_is_the_api_name(make_server):
    engine, server = await make_server(served_model_name="house-llm")
    assert engine.model_name == "house-llm"
    status, _, body = await http_get(server.port, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["house-llm"]
    status, _, body = await http_get(server.port, "/health")
    assert status == 200 and json.loads(body)["model"] == "house-llm"
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                max_retries=0, timeout=120)
    chat = await client.chat.completions.create(
        model="house-llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "house-llm" and chat.usage.completion_tokens == 2
    # the checkpoint's own name is not served any more
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi",
                                        max_tokens=2)
    assert e.value.code == "model_not_found" and "house-llm" in e.value.message
    status, _, body = await http_get(server.port, "/metrics")
    assert status == 200 and 'model_name="house-llm"' in body
    await client.close()


@pytest.mark.parametrize("name", ["", "   ", "a\nb"])
def test_blank_or_unprintable_served_model_name_is_refused(name):
    from service.config import ModelConfig

    with pytest.raises(ValueError, match="served_model_name"):
        ModelConfig(served_model_name=name)
