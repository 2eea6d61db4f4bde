"""A `conveyor serve` subprocess for one benchmark target.

The server runs in its own process so that the client's measurements do not share its
event loop or GIL. `conveyor serve --port 0` would not tell us the port it took, so a
free port is picked here (bind to port 0, read it, release it) and passed with --port;
readiness is `GET /health` answering 200 (the server listens only once the model is
loaded). Its output goes to a log file whose tail is shown if it fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from types import TracebackType

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m service.cli serve --host 127.0.0.1 --port P <serve_args>` as a subprocess.

    Use as a context manager, or `start()` then `close()`. `url` is the WebSocket
    endpoint once started.

    Args:
        serve_args: `conveyor serve` flags (engine options), e.g. ["--max-num-seqs", "8"].
        start_timeout_s: seconds allowed for the model to load and /health to answer 200.
    """

    def __init__(self, serve_args: Sequence[str] = (), *, start_timeout_s: float = 600.0) -> None:
        self.serve_args = list(serve_args)
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="conveyor-bench-server-", suffix=".log",
                                                delete=False)

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/v1/stream"

    @property
    def health_url(self) -> str:
        return f"http://{HOST}:{self.port}/health"

    @property
    def log_path(self) -> str:
        return self._log.name

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "service.cli", "serve", "--host", HOST,
                "--port", str(self.port), "--log-level", "warning", *self.serve_args]

    def start(self) -> ServerProcess:
        """Start the process and wait until /health answers 200.

        Raises RuntimeError (with the log's tail) if the process exits first or does not
        become healthy within start_timeout_s (it is then stopped).
        """
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"the server was not healthy within {self.start_timeout_s:g} s:\n"
                           f"{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop the server (SIGINT, then SIGKILL after timeout_s). Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `conveyor serve` exits cleanly on Ctrl-C
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
