"""CPU swap space: a plain allocator of CPU KV block ids (no hashing, no sharing).

The bytes live in the model runner (one pinned-if-possible CPU tensor per layer,
shaped like the device KV cache); this object only decides which CPU block holds
which swapped-out device block. Capacity is a return value ([] when short).
"""

from __future__ import annotations


class SwapSpace:
    """`num_blocks` CPU blocks, handed out lowest id first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` CPU block ids, or [] (nothing taken) when fewer are free."""
        if n > len(self._free):
            return []
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):
            assert 0 <= b < self.num_blocks and b not in self._free, f"bad free of CPU block {b}"
            self._free.append(b)

    def check_integrity(self, held: list[list[int]]) -> None:
        """Held + free == total, with no block both held and free or held twice."""
        flat = [b for blocks in held for b in blocks]
        assert len(set(flat)) == len(flat), f"a CPU block is held twice: {sorted(flat)}"
        assert not set(flat) & set(self._free), "a held CPU block is also free"
        assert len(flat) + len(self._free) == self.num_blocks, (
            f"{len(flat)} held + {len(self._free)} free != {self.num_blocks} CPU blocks")
