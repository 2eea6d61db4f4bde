"""/metrics over a request's life, one log line per finished request, the README's Engine example."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import structlog

from protocol import Delta, Done, connect

ROOT = Path(__file__).resolve().parents[2]


async def _http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = re.compile(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} ([0-9.e+-]+)$", re.M)
    m = pat.search(text)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))


async def test_metrics_follow_a_request(make_server):
    engine, server = await make_server()
    _, before = await _http_get(server.port, "/metrics")
    assert _metric(before, "conveyor:num_requests_running") == 0
    gen0 = _metric(before, "conveyor:generation_tokens_total")
    ok0 = _metric(before, "conveyor:request_success_total", 'finished_reason="length"')
    running_seen = 0.0
    async with await connect(server.url) as client:
        assert _metric((await _http_get(server.port, "/metrics"))[1],
                       "conveyor:websocket_connections") == 1
        stream = client.generate(prompt="Tell me about the sea.", max_tokens=24, ignore_eos=True)
        done = None
        async for ev in stream:
            if isinstance(ev, Delta) and ev.index == 2:
                _, mid = await _http_get(server.port, "/metrics")
                running_seen = _metric(mid, "conveyor:num_requests_running")
                assert 0 < _metric(mid, "conveyor:kv_cache_usage_perc") <= 1
            elif isinstance(ev, Done):
                done = ev
    assert running_seen == 1
    await asyncio.sleep(0.05)
    _, after = await _http_get(server.port, "/metrics")
    assert _metric(after, "conveyor:num_requests_running") == 0
    assert _metric(after, "conveyor:num_requests_waiting") == 0
    assert _metric(after, "conveyor:kv_cache_usage_perc") == 0
    assert _metric(after, "conveyor:websocket_connections") == 0
    assert _metric(after, "conveyor:generation_tokens_total") - gen0 == done.usage.completion_tokens
    assert _metric(after, "conveyor:prompt_tokens_total") == done.usage.prompt_tokens
    assert _metric(after, "conveyor:request_success_total", 'finished_reason="length"') == ok0 + 1
    assert _metric(after, "conveyor:time_to_first_token_seconds_count") == 1
    assert _metric(after, "conveyor:inter_token_latency_seconds_count") == 23
    assert "conveyor:iteration_tokens_total_bucket" in after
    assert "conveyor:prefix_cache_queries_total" in after


async def test_one_log_line_per_finished_request(make_server):
    engine, server = await make_server()
    with structlog.testing.capture_logs() as logs:
        async with await connect(server.url) as client:
            async for _ in client.generate(prompt="Hi", max_tokens=3, id="logged"):
                pass
    done = [e for e in logs if e["event"] == "request_finished"]
    assert len(done) == 1
    line = done[0]
    assert line["request_id"] == "logged" and line["connection_id"].startswith("c")
    assert line["completion_tokens"] == 3 and line["finish_reason"] in ("length", "stop")
    for key in ("prompt_tokens", "cached_tokens", "ttft_ms", "e2e_ms", "queue_ms"):
        assert key in line


def test_readme_engine_example_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Embedding the engine", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout
    assert "'What is the capital of France?': " in proc.stdout
