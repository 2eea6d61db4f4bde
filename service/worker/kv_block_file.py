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
    56+4n+P     32     SHA-256 of every byte before it

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

__all__ = ["BlockFileError", "file_nbytes", "read_block_file", "read_block_file_into",
           "write_block_file"]


class BlockFileError(Exception):
    """A block file failed verification. `reason`: "truncated", "magic", "fingerprint",
    "digest", "tokens", "size" or "checksum"."""

    def __init__(self, reason: str, path: str | os.PathLike) -> None:
        super().__init__(f"{path}: bad KV block file ({reason})")
        self.reason = reason
        self.path = str(path)


def _checksum(data: bytes):
    """The checksum's hash object: SHA-256, which the CPU's SHA extensions compute at
    1-2 GB/s where present (blake2b ran at 0.55 GB/s, 2/3 of a load, on the dev machine)."""
    return hashlib.sha256(data)


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
    check = _checksum(head)
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
    """The verified payload of the block file at `path` (a new bytearray, writable, so
    `torch.frombuffer` can view it); see read_block_file_into."""
    out = bytearray(payload_nbytes)
    read_block_file_into(path, fingerprint, digest, token_ids, memoryview(out))
    return out


def read_block_file_into(path: Path, fingerprint: bytes, digest: bytes,
                         token_ids: Sequence[int], out: memoryview) -> None:
    """Read the block file at `path` and verify it, its payload straight into `out`
    (a writable buffer of exactly the payload's size, e.g. a staging tensor's bytes).

    token_ids: the tokens the caller expects in this block. Raises FileNotFoundError
    when there is no file, BlockFileError when it fails a check (`out` then holds
    garbage), OSError for other I/O errors.
    """
    out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    payload_nbytes = out.nbytes
    expected = file_nbytes(len(token_ids), payload_nbytes)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected:
            raise BlockFileError("truncated" if size < expected else "size", path)
        head = f.read(_HEAD.size + 4 * len(token_ids))
        got = f.readinto(out)
        tail = f.read(CHECKSUM_BYTES + 1)
    if len(head) != _HEAD.size + 4 * len(token_ids) or got != payload_nbytes or \
            len(tail) != CHECKSUM_BYTES:
        raise BlockFileError("truncated", path)  # shrank while being read
    magic, fp, dg, n, _, p = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise BlockFileError("magic", path)
    if fp != fingerprint:
        raise BlockFileError("fingerprint", path)
    if dg != digest:
        raise BlockFileError("digest", path)
    if n != len(token_ids) or p != payload_nbytes:
        raise BlockFileError("size", path)
    if head[_HEAD.size:] != tokens_to_bytes(token_ids):
        raise BlockFileError("tokens", path)
    check = _checksum(head)
    check.update(out)
    if check.digest() != tail:
        raise BlockFileError("checksum", path)
