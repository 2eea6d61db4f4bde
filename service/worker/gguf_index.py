"""A GGUF file's tensor table and scalar metadata, read straight from its header.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata field, the
tokenizer's 49,152 tokens and 48,900 merges included: 2.5-2.9 s of every start-up of a
SmolLM2-vocabulary file on 2 Zen 4 cores (2026-12-06), at every model size. Serving needs
none of those arrays once transformers' config and tokenizer come from their cache
(``gguf_meta_cache``): only the tensors' names, types, shapes and offsets, and a few scalars.
This reads the header as the format defines it (ggml's docs/gguf.md: magic "GGUF", version
2 or 3, little-endian; key/value pairs; tensor infos; the data section aligned to
``general.alignment``, 32 by default), steps over arrays without materializing them (tens of
milliseconds), and maps the data section once. The gguf package stays the source of the
block types (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``); ``GGUFFile`` falls back to its
reader for a file this does not read (a big-endian or version-1 file).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value types (docs/gguf.md, gguf_metadata_value_type): struct code of each fixed-size one
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor: `shape` as the file stores it (the row length first, as gguf's reader
    gives it), `tensor_type` a ``gguf.GGMLQuantizationType``, `data` its bytes ([nbytes]
    uint8, a view of the mapped file)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> Any:
        """A scalar or string value; an array is stepped over (None) unless its elements are
        fixed-size and few (then a tuple)."""
        if vtype in _FIXED:
            return self.take(_FIXED[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, count = self.take("I"), self.take("Q")
        if etype == _STRING:
            self.skip_strings(count)
            return None
        if etype not in _FIXED:
            raise ValueError(f"unsupported GGUF array element type {etype}")
        size = struct.calcsize(_FIXED[etype])
        start = self.pos
        self.pos += size * count
        if count > 64:
            return None
        return struct.unpack_from(f"<{count}{_FIXED[etype]}", self.buf, start)


class GGUFIndex:
    """The tensors (``tensors``: name -> IndexedTensor) and scalar metadata (``fields``: key
    -> value; arrays of more than 64 elements and arrays of strings are None) of the GGUF
    file at `path`. Raises ValueError for a file this cannot read."""

    def __init__(self, path: str) -> None:
        import gguf

        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        if len(mapped) < 24 or bytes(mapped[:4]) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        cur = _Cursor(memoryview(mapped))  # type: ignore[arg-type]
        cur.pos = 4
        try:
            version = cur.take("I")
            if version not in (2, 3):  # a big-endian file reads as a huge version too
                raise ValueError(f"{path}: GGUF version {version} (2 or 3, little-endian, read)")
            n_tensors, n_kv = cur.take("Q"), cur.take("Q")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.fields[key] = cur.value(cur.take("I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
                infos.append((name, dims, cur.take("I"), cur.take("Q")))
        except struct.error as e:
            raise ValueError(f"{path}: GGUF header cut short ({e})") from e
        align = int(self.fields.get("general.alignment") or DEFAULT_ALIGNMENT)
        start = -(-cur.pos // align) * align
        self.tensors: dict[str, IndexedTensor] = {}
        for name, dims, ttype, offset in infos:
            kind = gguf.GGMLQuantizationType(ttype)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims)) if dims else 1
            nbytes = count // block * size
            begin = start + offset
            if count % block or begin + nbytes > len(mapped):
                raise ValueError(f"{path}: tensor {name} ({kind.name} {dims}) does not fit the "
                                 "file")
            self.tensors[name] = IndexedTensor(name, dims, kind, mapped[begin:begin + nbytes])
