"""The EngineClient conformance check against the cluster's RemoteEngine, on a real Ray
Serve cluster (2 replicas, the real model), and the front app's OpenAI route through the
Ray ingress (the same app as one process, a RemoteEngine behind it)."""

from __future__ import annotations

import json
import urllib.request

from tests.cluster.conftest import cluster_marks
from tests.service.engine_client_checks import check_engine_client

pytestmark = cluster_marks


async def test_remote_engine_honours_the_engine_client_contract(cluster):
    from ray import serve

    from service.cluster.app import ENGINE_DEPLOYMENT
    from service.cluster.ingress_metrics import IngressMetrics
    from service.cluster.remote_engine import RemoteEngine

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="conveyor")
    info = await handle.info.remote()
    engine = RemoteEngine(handle, info, IngressMetrics(info.model_name))
    try:
        await check_engine_client(engine)
    finally:
        await engine.close()


def test_chat_completions_through_the_ray_ingress(cluster):
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(cluster.http + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0
    status, text = cluster.get("/health")
    assert status == 200 and '"replicas":2' in text

