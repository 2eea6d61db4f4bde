"""A port that cannot be bound: FrontServer.start raises ListenError naming the host, port and
way out, and `conveyor serve` prints it as one line (exit 2), no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from service.config import ServerConfig
from service.front.server import FrontServer, ListenError


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


async def test_a_taken_port_raises_listen_error(taken_port) -> None:
    with pytest.raises(ListenError) as e:
        await FrontServer(None, ServerConfig(host="127.0.0.1", port=taken_port),
                          starting="loading").start()
    assert f"127.0.0.1:{taken_port}" in str(e.value) and "--port 0" in str(e.value)
    assert isinstance(e.value, OSError) and e.value.errno is not None


def test_serve_on_a_taken_port_says_so_in_one_line(taken_port) -> None:
    r = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
                        "--port", str(taken_port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"conveyor: cannot listen on 127.0.0.1:{taken_port}" in r.stderr, r.stderr
