"""A GGUF file's config and tokenizer as transformers builds them, kept on disk after the
first load (a start-up cost, not a numerical change).

transformers turns a GGUF file's metadata into a config and a fast tokenizer on every load:
it converts every metadata field to Python values and rebuilds the BPE tokenizer from the
vocabulary and merges (49,152 tokens for SmolLM2's). On the 2-core Zen 4 with other
processes running, that took 14 s for the config and 15 s for the tokenizer of an 8B-shaped
file (one shared parse, ``gguf_parse.py``, makes it less, not little), where the same
config and tokenizer read back from transformers' own ``save_pretrained`` folder took 2 s.

``config_and_tokenizer`` keeps that folder under ``$CONVEYOR_CACHE_DIR/gguf-meta/<key>``,
key = a hash of the file's real path, size and modification time and of transformers'
version and this module's ``CACHE_VERSION``, so a changed file or a new transformers
builds it again. transformers stays the source of both: the folder is its own output, read
by its own loaders (the tests hold the two equal: vocabulary, special tokens, chat template,
encodings, config). A folder is written to a temporary name and renamed, so servers that
share the cache never read half of one; a cache that cannot be written is skipped with a
debug line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kernels.cpu_build import cache_dir

log = logging.getLogger(__name__)

CACHE_VERSION = 1
"""Bump when what is stored changes: older folders are then not read."""
DONE = "conveyor-complete"
"""The marker file written last into a complete folder."""


def meta_dir(path: str) -> Path:
    """Where the config and tokenizer of the GGUF file at `path` are kept (it may not exist)."""
    import transformers

    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|"
                         f"{CACHE_VERSION}".encode()).hexdigest()[:16]
    return cache_dir().parent / "gguf-meta" / key


def config_and_tokenizer(path: str, folder: str, kw: dict[str, Any]) -> tuple[Any, Any, bool]:
    """(config, tokenizer, whether they came from the cache) of the GGUF file at `path`
    (``folder`` and ``kw``: its folder and ``{"gguf_file": name}`` as transformers takes
    them). Raises what transformers raises for a file it cannot read."""
    from transformers import AutoConfig, AutoTokenizer

    where = meta_dir(path)
    if (where / DONE).exists():
        try:
            config = AutoConfig.from_pretrained(where, local_files_only=True)
            config._name_or_path = folder  # as loaded from the file (nothing of ours reads it)
            return config, AutoTokenizer.from_pretrained(where, local_files_only=True), True
        except (OSError, ValueError) as e:  # a damaged folder: built again below
            log.debug("GGUF metadata cache %s unreadable (%s): building it again", where, e)
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **kw)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    _store(where, config, tokenizer)
    return config, tokenizer, False


def _store(where: Path, config: Any, tokenizer: Any) -> None:
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
        try:
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / DONE).write_text("")
            os.replace(tmp, where)  # atomic; fails if another server got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (where / DONE).exists():
                raise
    except OSError as e:
        log.debug("GGUF metadata cache %s not written: %s", where, e)
