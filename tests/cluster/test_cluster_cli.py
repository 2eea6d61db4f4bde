"""`conveyor serve --replicas N`: the one-line error without the extra, and the real
command from start to a graceful stop (SIGTERM drains like the single-process server)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from protocol import Delta, connect
from tests.cluster.conftest import HAVE_RAY, free_port
from tests.integration.stream_checks import collect


def test_replicas_without_the_extra_is_one_line_with_the_install_hint(monkeypatch, capsys):
    from service.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["serve", "--replicas", "2", "--log-level", "error"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--replicas needs the cluster extra" in err and "pip install -e '.[cluster]'" in err


@pytest.mark.parametrize("flags, field", [
    (["--replicas", "0"], "num_replicas"),
    (["--replicas", "2", "--min-replicas", "1"], "min_replicas/max_replicas"),
    (["--replicas", "2", "--num-cpus-per-replica", "0"], "num_cpus_per_replica"),
    (["--replicas", "2", "--match-rate-threshold", "0"], "match_rate_threshold"),
])
@pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed")
def test_bad_cluster_flags_fail_before_ray_starts(flags, field, capsys):
    from service.cli import main

    assert main(["serve", *flags, "--log-level", "error"]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.cluster
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed: "
                                         "pip install -e '.[cluster]'")
async def test_serve_replicas_until_sigterm_then_drain():
    port = free_port()
    ray_before = _ray_processes()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--replicas", "1",
         "--num-cpus-per-replica", "1", "--port", str(port), "--num-kv-blocks", "256",
         "--swap-space", "0", "--max-num-seqs", "8", "--shutdown-timeout", "60",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        url = await asyncio.wait_for(_serving_url(proc, lines), 600)
        assert url == f"ws://127.0.0.1:{port}/v1/stream"
        async with await connect(url) as client:
            stream = client.generate(prompt="Count: 1, 2, 3,", max_tokens=48,
                                     ignore_eos=True, temperature=0)
            first = await stream.__anext__()
            assert isinstance(first, Delta)
            proc.send_signal(signal.SIGTERM)  # drains: the request in flight finishes
            deltas, done = await asyncio.wait_for(collect(stream), 120)
        assert done.finish_reason == "length" and done.usage.completion_tokens == 48
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 120)
        out = "".join(lines) + proc.stdout.read()
        assert rc == 0, out[-3000:]
        assert "conveyor: shutting down" in out and "conveyor: stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30  # Ray's processes went with it
    while _ray_processes() - ray_before and time.monotonic() < deadline:
        await asyncio.sleep(1)
    assert not _ray_processes() - ray_before


async def _serving_url(proc: subprocess.Popen, lines: list[str]) -> str:
    while True:
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line:
            raise AssertionError("conveyor exited before serving:\n" + "".join(lines[-50:]))
        lines.append(line)
        if line.startswith("conveyor: serving at "):
            return line.split()[3]


def _ray_processes() -> set[tuple[int, str]]:
    """(pid, command) of the Ray processes on this machine."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    rows = [line.strip().split(None, 1) for line in out.splitlines()[1:]]
    return {(int(r[0]), r[1]) for r in rows if len(r) == 2 and
            any(k in r[1] for k in ("raylet", "gcs_server", "ray::", "ray/_private",
                                    "default_worker.py", "dashboard"))}


@pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed")
def test_serve_config_example_is_valid_and_builds_the_app():
    """The README's Serve config for existing clusters: Serve's schema accepts it and its
    import_path builds the application from its flags (no Ray needed to build)."""
    from pathlib import Path

    import yaml
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from service.cluster import app as app_module

    path = Path(app_module.__file__).with_name("serve_config.yaml")
    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config)
    spec = schema.applications[0]
    module, _, name = spec.import_path.partition(":")
    assert module == app_module.__name__
    assert isinstance(getattr(app_module, name)(spec.args), serve.Application)
    with pytest.raises(ValueError, match="args.flags"):
        app_module.app_builder({"replicas": 2})
    with pytest.raises(ValueError, match="num_replicas"):
        app_module.app_builder({"flags": "--replicas 0"})
