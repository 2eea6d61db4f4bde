"""The `conveyor serve` subprocess wrapper: a failed start is reported with the server's log."""

from __future__ import annotations

import socket

import pytest

from service.bench.server_process import ServerProcess, free_port


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_server_that_cannot_start_is_reported_with_its_log():
    server = ServerProcess(["--max-num-seqs", "0"], start_timeout_s=120)
    assert server.argv[-2:] == ["--max-num-seqs", "0"] and "--port" in server.argv
    try:
        with pytest.raises(RuntimeError, match="exited with code 2") as info:
            server.start()
        assert "--max-num-seqs must be >= 1" in str(info.value)
    finally:
        server.close()
    server.close()  # idempotent
