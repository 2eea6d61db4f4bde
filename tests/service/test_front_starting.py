"""The front's ASGI app before its engine exists (service/front/starting.py: the Ray
ingress's answers while replicas load, `conveyor serve`'s while the model loads):
/health 503 "starting", sockets closed 1013, the HTTP API 503 with an OpenAI error body
and Retry-After, the guard kept; then every request goes to the front app."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from service.front.access import AccessPolicy
from service.front.starting import StartingApp

KEY = "k-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make(failed: bool = False):
    front: list = []
    state = lambda: ("boom" if failed else "starting: the engine replicas are loading the "  # noqa: E731
                     "model (0 of 2 ready)", failed, {"replicas": 0, "expected_replicas": 2})
    app = StartingApp(AccessPolicy(KEY, ()), state, lambda: front[0] if front else None)
    return app, front


def test_health_is_503_starting_with_the_replica_counts():
    app, _ = make()
    with TestClient(app) as client:  # runs the lifespan too
        r = client.get("/health")
    assert r.status_code == 503
    assert r.json() == {"status": "starting", "reason": "starting: the engine replicas are "
                        "loading the model (0 of 2 ready)", "replicas": 0, "expected_replicas": 2}


def test_failed_start_is_unavailable():
    app, _ = make(failed=True)
    r = TestClient(app).get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert r.json()["reason"] == "boom"


def test_http_api_is_503_openai_error_with_retry_after_and_guarded():
    app, _ = make()
    client = TestClient(app)
    r = client.post("/v1/chat/completions", json={"messages": []}, headers=AUTH)
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    error = r.json()["error"]
    assert error["code"] == "model_loading" and error["type"] == "service_unavailable"
    assert "0 of 2" in error["message"]
    r = client.post("/v1/chat/completions", json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/metrics").status_code == 401
    r = client.get("/metrics", headers=AUTH)
    assert r.status_code == 503 and "starting" in r.json()["error"]


def test_socket_is_closed_1013_model_loading():
    app, _ = make()
    client = TestClient(app)
    with client.websocket_connect(f"/v1/stream?api_key={KEY}") as ws:
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_text()
    assert info.value.code == 1013 and "the model is loading" in info.value.reason


def test_once_the_front_exists_it_serves_everything():
    app, front = make()
    front.append(Starlette(routes=[Route("/health", lambda r: PlainTextResponse("front"))]))
    r = TestClient(app).get("/health")
    assert r.status_code == 200 and r.text == "front"
