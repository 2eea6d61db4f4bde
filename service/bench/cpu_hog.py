"""Busy neighbours for a contention benchmark: N processes that each keep one CPU busy.

Each hog is `yes` writing to /dev/null (the neighbour of the issue's measurement), or a
Python busy loop where `yes` is missing. They start when the context is entered and are
stopped (SIGTERM, then SIGKILL) when it exits, whatever happened inside.

    with CpuHog(1):
        ...   # the engine shares the machine with one busy process
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from types import TracebackType


class CpuHog:
    """N busy processes for the duration of a `with` block. n = 0 starts nothing.

    Raises ValueError for n < 0.
    """

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"the number of CPU hogs must be >= 0, got {n}")
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    @staticmethod
    def command() -> list[str]:
        yes = shutil.which("yes")
        return [yes] if yes else [sys.executable, "-c", "while True: pass"]

    def __enter__(self) -> CpuHog:
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL,
                                                   stdin=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> int:
        """How many hogs are still running."""
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Stop every hog this object started. Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
