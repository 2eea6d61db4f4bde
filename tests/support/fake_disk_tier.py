"""An in-memory `service.core.kv_disk.DiskTier` for scheduler tests: it keeps saved blocks'
digests and tokens, and finishes loads only when a test says so."""

from __future__ import annotations

from collections.abc import Sequence

from service.core.kv_disk import DiskBlock, LoadResult


class FakeDiskTier:
    """saved: digest -> DiskBlock (unless drop_saves); loads: key -> (digests, tokens) queued; installs:
    (key, block ids) in order; discarded: keys of results dropped unused."""

    def __init__(self, root: bytes = b"R" * 16, max_loads: int = 4) -> None:
        self.root = root
        self.enabled = True
        self.max_loads = max_loads
        self.saved: dict[bytes, DiskBlock] = {}
        self.save_calls: list[list[DiskBlock]] = []
        self.eviction_saves: list[list[DiskBlock]] = []  # per save(evicting=True): new ones
        self.drop_saves = False  # as a full write queue: saves are recorded, not kept
        self.loads: dict[str, tuple[list[bytes], list[tuple[int, ...]]]] = {}
        self.installs: list[tuple[str, list[int]]] = []
        self.discarded: list[str] = []
        self._done: list[LoadResult] = []

    def lookup(self, digests: Sequence[bytes]) -> int:
        n = 0
        while n < len(digests) and digests[n] in self.saved:
            n += 1
        return n if self.enabled else 0

    def save(self, blocks: Sequence[DiskBlock], evicting: bool = False) -> None:
        self.save_calls.append(list(blocks))
        if evicting:
            self.eviction_saves.append([b for b in blocks if b.digest not in self.saved])
        if self.drop_saves:
            return
        for b in blocks:
            self.saved.setdefault(b.digest, b)

    def load(self, key: str, digests: Sequence[bytes],
             token_ids: Sequence[tuple[int, ...]]) -> bool:
        if not self.enabled or len(self.loads) >= self.max_loads:
            return False
        for d, t in zip(digests, token_ids):
            assert self.saved[d].token_ids == t, "asked for a block with other tokens"
        self.loads[key] = (list(digests), list(token_ids))
        return True

    def complete(self, key: str, num_blocks: int | None = None) -> None:
        """Finish load `key` with its first `num_blocks` blocks read (default: all)."""
        digests, _ = self.loads.pop(key)
        n = len(digests) if num_blocks is None else num_blocks
        self._done.append(LoadResult(key, n, 0.001, digests[:n]))

    def poll(self) -> list[LoadResult]:
        done, self._done = self._done, []
        return done

    def install(self, result: LoadResult, block_ids: Sequence[int]) -> None:
        assert len(block_ids) <= result.num_blocks
        self.installs.append((result.key, list(block_ids)))

    def discard(self, result: LoadResult) -> None:
        self.discarded.append(result.key)
