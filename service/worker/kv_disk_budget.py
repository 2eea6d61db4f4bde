"""One `--kv-disk-size` budget per `--kv-disk-path` directory, shared by every engine on it.

Engines (servers, Ray replicas, `LLM`s) given the same DIR share its block files; the size
limit is the directory's: the bytes of every block file under DIR, whatever fingerprint
(model, dtype, layout) and whichever engine wrote it. Each engine knows only its own index,
so the directory's total lives in a ledger beside the blocks:

    DIR/.kv-disk-bytes        the total, decimal bytes
    DIR/.kv-disk-bytes.lock   an exclusive `flock` held while the total is read and changed

Every change of the directory's block files goes through the lock: a write adds its file's
size, a deletion that succeeds (`unlink` did not find it gone: another engine may have
deleted it first) subtracts it. A writer that would take the total over the budget evicts
its own least recently used sequence ends first (the blocks other engines hold are theirs
to evict); when those cannot make room it does not write. At start-up an engine recounts the
directory under the lock (a crash between a file operation and the ledger's update, or a
ledger that cannot be read, is mended there). `flock` locks are per open file and work
between processes on one machine (on network file systems, only where they support it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DirectoryLedger", "directory_bytes"]

LEDGER = ".kv-disk-bytes"
SUFFIX = ".kvb"


def directory_bytes(root: Path) -> int:
    """Bytes of every block file under root: root/<fingerprint>/<xx>/<digest>.kvb."""
    total = 0
    for fp in os.scandir(root):
        if not fp.is_dir(follow_symlinks=False):
            continue
        for sub in os.scandir(fp.path):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    try:
                        total += entry.stat().st_size
                    except OSError:
                        pass  # deleted meanwhile
    return total


class Held:
    """The ledger while its lock is held: `total` bytes, changed in place, written back
    when the lock is let go."""

    def __init__(self, total: int) -> None:
        self.total = total

    def add(self, nbytes: int) -> None:
        self.total = max(0, self.total + nbytes)


class DirectoryLedger:
    """The directory's total bytes of block files (see the module docstring).

    root: the `--kv-disk-path` directory (created by the caller). Raises OSError where
    the ledger's files cannot be created.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LEDGER
        self.lock_path = self.root / (LEDGER + ".lock")
        self.lock_path.touch(exist_ok=True)

    @contextlib.contextmanager
    def locked(self, *, recount: bool = False) -> Iterator[Held]:
        """Hold the directory's lock; yields the total (recounted from the files when
        `recount` or when the ledger cannot be read) and writes it back on exit."""
        with open(self.lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                total = None if recount else self._read()
                held = Held(directory_bytes(self.root) if total is None else total)
                yield held
                self._write(held.total)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _read(self) -> int | None:
        try:
            text = self.path.read_text(encoding="ascii").strip()
            return int(text) if text.isdigit() else None
        except (OSError, ValueError):
            return None

    def _write(self, total: int) -> None:
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}.tmp")
        tmp.write_text(str(total), encoding="ascii")
        os.replace(tmp, self.path)
