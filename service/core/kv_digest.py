"""Stable content addresses of KV blocks, for storage that outlives the process.

The pool's `chain_hash` is Python's `hash()`, which differs between processes (in
Python 3.11 `hash(None)` is derived from an address), so it cannot name a file that
a restarted engine or another replica reads. A disk block is named instead by

    digest_0 = blake2b(root || tokens_0)
    digest_j = blake2b(digest_{j-1} || tokens_j)

where `root` is the 16-byte fingerprint of everything that changes the KV bytes
(model file, dtype, block size, layer and head layout, rope, quantization, batch
invariance; `service.worker.kv_fingerprint`) and tokens_j are block j's token ids as
little-endian uint32. A different fingerprint yields different digests for the same
tokens: two settings never name each other's blocks.

Pure (hashlib only); blake2b of a 16-token block costs about a microsecond.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_BYTES = 16

__all__ = ["DIGEST_BYTES", "block_digests", "digest_block", "tokens_to_bytes"]


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (ids must be in [0, 2**32); struct.error if not)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def digest_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The 16-byte digest of one full block: `parent` is the previous block's digest,
    or the fingerprint for block 0."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(tokens_to_bytes(token_ids))
    return h.digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
                  parent: bytes | None = None) -> list[bytes]:
    """Digests of the full blocks of `token_ids` from block index `start` on.

    root: the fingerprint (block 0's parent). parent: the digest of block `start - 1`
    (required when start > 0). E.g. block_size 4, 10 tokens, start 0 -> 2 digests
    (tokens 0-3 and 4-7; 8-9 are not a full block).
    """
    if start > 0 and parent is None:
        raise ValueError("parent digest required when start > 0")
    prev = root if start == 0 else parent
    out: list[bytes] = []
    for b in range(start, len(token_ids) // block_size):
        prev = digest_block(prev, token_ids[b * block_size:(b + 1) * block_size])
        out.append(prev)
    return out
