"""A `conveyor serve` subprocess for one benchmark target.

The server runs in its own process so that the client's measurements do not share its
event loop or GIL. `conveyor serve --port 0` would not tell us the port it took, so a
free port is picked here (bind to port 0, read it, release it) and passed with --port;
readiness is `GET /health` answering 200 (it answers 503 "starting" while the model
loads). Its output goes to a log file whose tail is shown if it fails to start.
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
from typing import Self

HOST = "127.0.0.1"


def signal_name(returncode: int | None) -> str | None:
    """The signal that killed a process (a negative return code), e.g. -4 -> "SIGILL"."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def exit_text(returncode: int) -> str:
    """How a process ended, for people. E.g. -4 -> "killed by signal SIGILL (exit code -4)",
    3 -> "exit code 3"."""
    sig = signal_name(returncode)
    return f"killed by signal {sig} (exit code {returncode})" if sig else f"exit code {returncode}"


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HealthCheckedProcess:
    """A server subprocess on a free local port: started, ready once `health_url` answers
    200, stopped with `stop_signal` (then SIGKILL); its output goes to a log file whose
    tail is shown when it fails to start. Subclasses give `argv` and `health_url`.

    Use as a context manager, or `start()` then `close()`.
    """

    name = "the server"          # in error messages
    stop_signal = signal.SIGINT
    poll_s = 0.5                 # between health checks while starting
    close_timeout_s = 15.0

    def __init__(self, *, start_timeout_s: float, log_prefix: str) -> None:
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)

    @property
    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def health_url(self) -> str:
        raise NotImplementedError

    @property
    def env(self) -> dict[str, str] | None:
        return None

    @property
    def log_path(self) -> str:
        return self._log.name

    def start(self) -> Self:
        """Start the process and wait until /health answers 200.

        Raises RuntimeError (with the log's tail) if the process exits first or does not
        become healthy within start_timeout_s (it is then stopped).
        """
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                sig = signal_name(rc)
                raise RuntimeError(f"{self.name} exited with code {rc}"
                                   f"{f' (killed by {sig})' if sig else ''} while starting:\n"
                                   f"{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(self.poll_s)
        self.close()
        raise RuntimeError(f"{self.name} was not healthy within {self.start_timeout_s:g} s:\n"
                           f"{self.log_tail()}")

    def _healthy(self) -> bool:
        try:  # e.g. 503 while a model loads, 200 once it serves
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def exited(self, wait_s: float = 0.0) -> int | None:
        """The return code if the process has ended (waiting up to wait_s for it), else None.
        A process that crashed while serving may take a moment to be reaped."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def close(self, timeout_s: float | None = None) -> None:
        """Stop it (stop_signal, then SIGKILL after timeout_s). Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(self.stop_signal)
            try:
                proc.wait(self.close_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ServerProcess(HealthCheckedProcess):
    """`python -m service.cli serve --host 127.0.0.1 --port P <serve_args>` as a subprocess
    (stopped with SIGINT: `conveyor serve` exits cleanly on Ctrl-C). `url` is the WebSocket
    endpoint once started.

    Args:
        serve_args: `conveyor serve` flags (engine options), e.g. ["--max-num-seqs", "8"].
        start_timeout_s: seconds allowed for the model to load and /health to answer 200.
    """

    def __init__(self, serve_args: Sequence[str] = (), *, start_timeout_s: float = 600.0) -> None:
        super().__init__(start_timeout_s=start_timeout_s, log_prefix="conveyor-bench-server-")
        self.serve_args = list(serve_args)

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/v1/stream"

    @property
    def health_url(self) -> str:
        return f"http://{HOST}:{self.port}/health"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "service.cli", "serve", "--host", HOST,
                "--port", str(self.port), "--log-level", "warning", *self.serve_args]

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1")
