"""One parse of a GGUF file per model load (a start-up cost, not a numerical change).

Loading a GGUF checkpoint through transformers reads the file three times, once each for
the config, the tokenizer and the weights, and our block reader
(``service.worker.gguf_weights``) reads it a fourth time. Each ``gguf.GGUFReader`` parses
every metadata field: on SmolLM2-135M-Instruct's file, whose tokenizer holds 49,152
tokens and their merges, that took 4 s and 167 MB on a 2-core Zen 4. While mapping the
weights' names, transformers also builds ``gguf.get_tensor_name_map(arch, n_blocks)``
once per module (397 times for that model, 5.7 s), though the map depends on its two
arguments only.

``shared_gguf_parse()`` makes both of these happen once while it is open. It replaces the
``gguf`` package's ``GGUFReader`` and ``get_tensor_name_map`` attributes, which
transformers imports inside its loader at each call, with memoizing wrappers. On leaving
it puts the originals back and drops the parsed files. Readers are only read: transformers
and our block reader take fields and tensor views and never write them. The context
nests: an inner one (``load_model``'s own) shares an outer one's readers (a ModelRunner's,
which also reads the blocks). It is not thread-safe: model loads run one at a time in a
process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_depth = 0
_readers: dict[tuple[str, str], Any] = {}
_name_maps: dict[tuple[Any, int], Any] = {}


@contextlib.contextmanager
def shared_gguf_parse() -> Iterator[None]:
    """Within it each GGUF file is parsed once and each tensor name map built once (see the
    module docstring). A no-op where the ``gguf`` package is missing."""
    global _depth
    try:
        import gguf
    except ImportError:
        yield
        return
    outermost = _depth == 0  # it patches and, leaving last, restores
    if outermost:
        reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in _readers:
                _readers[key] = reader_cls(path, mode)
            return _readers[key]

        def name_map(arch: Any, n_blocks: int) -> Any:
            if (arch, n_blocks) not in _name_maps:
                _name_maps[(arch, n_blocks)] = name_map_fn(arch, n_blocks)
            return _name_maps[(arch, n_blocks)]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if outermost:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map_fn
            _readers.clear()
            _name_maps.clear()


def parses() -> int:
    """GGUF files parsed by the open context so far (0 outside one): for tests."""
    return len(_readers)
