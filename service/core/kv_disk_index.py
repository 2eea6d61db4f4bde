"""Which KV blocks the disk tier holds, and which to evict: LRU by bytes (pure, no I/O).

The index maps a block's digest (`service.core.kv_digest`) to its file's size in
bytes, in LRU order (front = least recently used). The tier's writer thread adds
entries and the step thread looks them up, so every method takes one lock.

    entries [ LRU ............................................ MRU ]
    make_room(n) pops from the front until total + n <= capacity.

It is rebuilt at start-up from the files on disk (oldest modification time first),
so a restart keeps both the blocks and their recency.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["DiskIndex"]


class DiskIndex:
    """Digest -> file size (bytes), LRU ordered, bounded by `capacity_bytes`.

    Args:
        capacity_bytes: most bytes of block files the tier keeps (>= 1).
    Raises ValueError for a capacity < 1.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        """Bytes of every block file indexed."""
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def leading_hits(self, digests: Iterable[bytes]) -> int:
        """How many of `digests`, from the first, are indexed (stops at the first miss)."""
        n = 0
        with self._lock:
            for d in digests:
                if d not in self._entries:
                    break
                n += 1
        return n

    def touch(self, digest: bytes) -> None:
        """Mark a block used now (it moves to the MRU end); unknown digests are ignored."""
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)

    def make_room(self, nbytes: int) -> list[bytes] | None:
        """Evict LRU entries until `nbytes` more fit; returns the evicted digests (their
        files are the caller's to delete), or None (nothing evicted) when `nbytes` alone
        exceeds the capacity."""
        if nbytes > self.capacity_bytes:
            return None
        evicted: list[bytes] = []
        with self._lock:
            while self._total + nbytes > self.capacity_bytes and self._entries:
                d, size = self._entries.popitem(last=False)
                self._total -= size
                evicted.append(d)
        return evicted

    def add(self, digest: bytes, nbytes: int) -> None:
        """Index a block file (at the MRU end); re-adding one updates its size."""
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._total -= old
            self._entries[digest] = nbytes
            self._total += nbytes

    def discard(self, digest: bytes) -> bool:
        """Forget a block (its file is gone or bad). True when it was indexed."""
        with self._lock:
            size = self._entries.pop(digest, None)
            if size is None:
                return False
            self._total -= size
            return True

    def lru_order(self) -> list[bytes]:
        """Digests from least to most recently used (tests and diagnostics)."""
        with self._lock:
            return list(self._entries)
