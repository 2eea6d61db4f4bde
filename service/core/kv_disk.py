"""What the scheduler needs of a disk KV tier (`service.worker.kv_disk_tier.DiskTier` is
one; unit tests use an in-memory fake). Pure: no torch, no I/O here.

The tier is keyed by stable block digests (`service.core.kv_digest`, rooted at
`root`, the engine's KV fingerprint). Every method is called on the step thread and
returns at once: saving copies the blocks' K/V out of the pool and queues the write;
loading queues a read whose result `poll()` returns in a later step, and
`install()` copies it into pool blocks the scheduler chose. Capacity is a return
value: a save the queue cannot take is dropped (counted), a load not queued is False.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = ["DiskBlock", "DiskTier", "LoadResult"]


class DiskBlock(NamedTuple):
    """A full pool block to save: its digest, its block_size token ids, its pool block id,
    and the digest of the block before it in its sequence (None for a sequence's first
    block): the tier evicts a prefix chain from its end, never its head first."""

    digest: bytes
    token_ids: tuple[int, ...]
    block_id: int
    parent: bytes | None = None


class LoadResult(NamedTuple):
    """A finished load: `key` as given to `load()`; `num_blocks` leading blocks read and
    verified (0 when the first one failed); `seconds` from load() to done; `payload`
    is the tier's own (pass it to install or discard)."""

    key: str
    num_blocks: int
    seconds: float
    payload: object


class DiskTier(Protocol):
    """A block store beside the pool. `root`: the 16-byte fingerprint digest (block 0's
    parent in the digest chain); `enabled`: False once an I/O error turned it off."""

    root: bytes
    enabled: bool

    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, the tier holds (0 when disabled)."""
        ...

    def save(self, blocks: Sequence[DiskBlock], evicting: bool = False) -> None:
        """Copy these blocks' K/V out of the pool now and write them behind; blocks the
        tier holds or already queued are skipped, those the queue cannot take dropped.
        evicting: the pool is about to overwrite them (counted apart)."""
        ...

    def load(self, key: str, digests: Sequence[bytes],
             token_ids: Sequence[tuple[int, ...]]) -> bool:
        """Queue a read of these blocks (their digests and expected tokens, in order);
        False when not queued (disabled, or too many loads in flight)."""
        ...

    def poll(self) -> list[LoadResult]:
        """Loads finished since the last call."""
        ...

    def install(self, result: LoadResult, block_ids: Sequence[int]) -> None:
        """Copy the first len(block_ids) blocks of a finished load into these pool blocks."""
        ...

    def discard(self, result: LoadResult) -> None:
        """Drop a finished load's payload unused."""
        ...
