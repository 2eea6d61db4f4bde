"""Which KV blocks the disk tier holds, and which to evict: LRU by bytes among the ends of
prefix chains (pure, no I/O).

The index maps a block's digest (`service.core.kv_digest`) to its file's size in
bytes, in LRU order (front = least recently used), and, where known, each block to its
parent: the block before it in its sequence. The tier's writer thread adds entries and the
step thread looks them up, so every method takes one lock.

    entries [ LRU ............................................ MRU ]
    make_room(n) evicts from the front until total + n <= capacity, taking only leaves:
    blocks no indexed block names as its parent.

A block is only reachable through its whole chain (a lookup counts leading hits), so a
chain's head evicted before its tail leaves the tail on disk and useless. Evicting leaves
only trims a chain from its end, as SGLang's radix cache evicts leaves and vLLM frees a
request's blocks tail first. `touch_chain` marks a chain used from its end to its head, so
the head is the most recent of all. A block whose parent is not known (files found at
start-up, whose order comes from their modification times) is a leaf.

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
        self._parent: dict[bytes, bytes] = {}      # indexed block -> its parent's digest
        self._kids: dict[bytes, set[bytes]] = {}   # digest -> indexed blocks naming it
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

    def touch_chain(self, digest: bytes) -> list[bytes]:
        """Mark `digest` and its indexed ancestors used now, the block first and the chain's
        head last (the most recent of all); returns them in that order (the tier sets the
        files' times alike, so a restart keeps it). [] for an unknown digest."""
        with self._lock:
            chain: list[bytes] = []
            d: bytes | None = digest
            while d is not None and d in self._entries and len(chain) <= len(self._entries):
                chain.append(d)
                d = self._parent.get(d)
            for d in chain:
                self._entries.move_to_end(d)
            return chain

    def chain_bytes(self, digest: bytes) -> int:
        """Bytes of `digest` and its indexed ancestors (0 for an unknown digest): what a
        block after it must leave in place."""
        with self._lock:
            total, seen = 0, set()
            d: bytes | None = digest
            while d is not None and d in self._entries and d not in seen:
                seen.add(d)
                total += self._entries[d]
                d = self._parent.get(d)
            return total

    def make_room(self, nbytes: int, keep: Iterable[bytes] = ()) -> list[bytes] | None:
        """Evict least recently used leaves until `nbytes` more fit; returns the evicted
        digests (their files are the caller's to delete). `keep`: blocks that must stay,
        and with them their ancestors (a block about to be written names its parent here).
        None, with nothing evicted, when that cannot make room (or `nbytes` alone exceeds
        the capacity)."""
        if nbytes > self.capacity_bytes:
            return None
        with self._lock:
            kept: set[bytes] = set()
            for d in keep:
                while d is not None and d in self._entries and d not in kept:
                    kept.add(d)
                    d = self._parent.get(d)
            if sum(self._entries[d] for d in kept) + nbytes > self.capacity_bytes:
                return None
            evicted: list[bytes] = []
            # No block outside `kept` has a kept descendant (a kept block's ancestors are
            # kept), so while the total is over, some block outside `kept` is a leaf.
            while self._total + nbytes > self.capacity_bytes:
                victim = next((d for d in self._entries
                               if d not in kept and not self._kids.get(d)), None)
                if victim is None:  # only a cycle of parents could do this: stop, not spin
                    break
                self._remove(victim)
                evicted.append(victim)
            return evicted

    def add(self, digest: bytes, nbytes: int, parent: bytes | None = None) -> None:
        """Index a block file (at the MRU end); re-adding one updates its size. `parent`:
        the block before it in its sequence, where known (kept from an earlier add when
        not given again)."""
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._total -= old
            self._entries[digest] = nbytes
            self._total += nbytes
            if parent is not None and digest not in self._parent and parent != digest:
                self._parent[digest] = parent
                self._kids.setdefault(parent, set()).add(digest)

    def link(self, digest: bytes, parent: bytes) -> None:
        """Record `parent` as the block before indexed `digest` in its chain, where not
        known yet (a load learns it for blocks found at start-up); nothing else changes,
        and an unknown digest is ignored."""
        with self._lock:
            if digest in self._entries and digest not in self._parent and parent != digest:
                self._parent[digest] = parent
                self._kids.setdefault(parent, set()).add(digest)

    def discard(self, digest: bytes) -> bool:
        """Forget a block (its file is gone or bad). True when it was indexed."""
        with self._lock:
            if digest not in self._entries:
                return False
            self._remove(digest)
            return True

    def _remove(self, digest: bytes) -> None:
        self._total -= self._entries.pop(digest)
        parent = self._parent.pop(digest, None)
        if parent is not None:
            kids = self._kids.get(parent)
            if kids is not None:
                kids.discard(digest)
                if not kids:
                    del self._kids[parent]

    def lru_order(self) -> list[bytes]:
        """Digests from least to most recently used (tests and diagnostics)."""
        with self._lock:
            return list(self._entries)
