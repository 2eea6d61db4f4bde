"""`conveyor serve` as a real subprocess on a free port, for tests that drive it with
clients nobody here wrote (the openai SDK, LangChain, Open WebUI): the command a user runs,
with the default model (SmolLM2-135M GGUF) unless flags say otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    """`python -m service.cli serve --port 0 FLAGS` with stdout and stderr read by threads
    (a full pipe never blocks it).

    `start()` waits for the "serving ... at ws://127.0.0.1:PORT/v1/stream" line (model load,
    about 30 s on 2 cores) and raises RuntimeError with the log tail if the process exits
    first or `timeout` seconds pass. `base_url` is http://127.0.0.1:PORT/v1.
    """

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.lines: list[str] = []
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600.0) -> ServeProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", "0", *self.flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()
        deadline = time.monotonic() + timeout
        pattern = re.compile(r"serving .* at ws://127\.0\.0\.1:(\d+)/v1/stream")
        while self.port is None:
            for line in list(self.lines):
                if m := pattern.search(line):
                    self.port = int(m.group(1))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("conveyor serve did not start:\n" + self.log_tail())
            time.sleep(0.05)
        return self

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace"))

    def log_tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    @property
    def base_url(self) -> str:
        assert self.port is not None
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
