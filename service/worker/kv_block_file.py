"""One KV block on disk: the file format, written atomically and verified on read.

Layout (little-endian; every field fixed-size but the token ids and payload):

    offset      bytes  field
    0           8      magic b"CVKVBLK1"
    8           16     fingerprint (the engine's KV fingerprint digest)
    24          16     digest (the block's chained content address, kv_digest)
    40          4      num_tokens n (uint32; the block size)
    44          4      reserved, 0
    48          8      payload_nbytes P (uint64)
    56          4n     token ids (uint32)
    56+4n       P      payload: the block's K/V of every layer, [L, 2, block_size, Hkv, D]
                       in the KV cache's dtype, C order (raw bytes)
    56+4n+P     32     blake2b-256 of every byte before it

A file is written under a temporary name in the same folder and renamed into place
(`os.replace`, atomic on POSIX), so a reader sees a whole file or none. A read checks
the length, magic, fingerprint, digest, token ids, payload size and checksum: any
mismatch raises `BlockFileError` (its `reason` names the check), so a torn, truncated
or corrupted file, or one of another model or setting, is a miss and never wrong KV.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from service.core.kv_digest import tokens_to_bytes

MAGIC = b"CVKVBLK1"
_HEAD = struct.Struct("<8s16s16sIIQ")  # magic, fingerprint, digest, n, reserved, P
CHECKSUM_BYTES = 32

__all__ = ["BlockFileError", "file_nbytes", "read_block_file", "write_block_file"]


class BlockFileError(Exception):
    """A block file failed verification. `reason`: "truncated", "magic", "fingerprint",
    "digest", "tokens", "size" or "checksum"."""

    def __init__(self, reason: str, path: str | os.PathLike) -> None:
        super().__init__(f"{path}: bad KV block file ({reason})")
        self.reason = reason
        self.path = str(path)


def file_nbytes(num_tokens: int, payload_nbytes: int) -> int:
    """Size in bytes of a block file with `num_tokens` ids and a payload of that size."""
    return _HEAD.size + 4 * num_tokens + payload_nbytes + CHECKSUM_BYTES


def write_block_file(path: Path, fingerprint: bytes, digest: bytes,
                     token_ids: Sequence[int], payload: memoryview | bytes) -> int:
    """Write one block file at `path` atomically (temporary name, then rename).

    payload: the raw K/V bytes (a memoryview of a contiguous tensor's bytes is not
    copied). Returns the file's size in bytes. Raises OSError (disk full, I/O error,
    permissions; the temporary file is removed).
    """
    payload = memoryview(payload).cast("B")
    head = _HEAD.pack(MAGIC, fingerprint, digest, len(token_ids), 0, payload.nbytes)
    tokens = tokens_to_bytes(token_ids)
    check = hashlib.blake2b(head, digest_size=CHECKSUM_BYTES)
    check.update(tokens)
    check.update(payload)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(tokens)
            f.write(payload)
            f.write(check.digest())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return file_nbytes(len(token_ids), payload.nbytes)


def read_block_file(path: Path, fingerprint: bytes, digest: bytes,
                    token_ids: Sequence[int], payload_nbytes: int) -> bytearray:
    """The verified payload of the block file at `path` (a bytearray, writable, so
    `torch.frombuffer` can view it without a copy).

    token_ids: the tokens the caller expects in this block; payload_nbytes: the size
    its KV layout implies. Raises FileNotFoundError when there is no file,
    BlockFileError when it fails a check, OSError for other I/O errors.
    """
    expected = file_nbytes(len(token_ids), payload_nbytes)
    with open(path, "rb") as f:
        data = bytearray(f.read(expected + 1))
    if len(data) != expected:
        raise BlockFileError("truncated" if len(data) < expected else "size", path)
    magic, fp, dg, n, _, p = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("magic", path)
    if fp != fingerprint:
        raise BlockFileError("fingerprint", path)
    if dg != digest:
        raise BlockFileError("digest", path)
    if n != len(token_ids) or p != payload_nbytes:
        raise BlockFileError("size", path)
    start = _HEAD.size
    if data[start:start + 4 * n] != tokens_to_bytes(token_ids):
        raise BlockFileError("tokens", path)
    body = memoryview(data)[:expected - CHECKSUM_BYTES]
    ok = hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest() == data[-CHECKSUM_BYTES:]
    body.release()
    if not ok:
        raise BlockFileError("checksum", path)
    payload_start = start + 4 * n
    del data[-CHECKSUM_BYTES:]
    del data[:payload_start]
    return data
