"""transformers' load-time progress bars: shown on a terminal, left out of a log.

Loading a GGUF checkpoint draws two tqdm bars: "Converting and de-quantizing GGUF
tensors..." (``tqdm.auto`` straight from ``transformers.modeling_gguf_pytorch_utils``) and
"Loading weights" (transformers' own wrapper). On a terminal they show a 5-20 s load
moving. Where stderr is a file or a pipe (a service manager, ``2> serve.log``, the bench's
server log) tqdm writes every redraw as more text: about 1 KB of carriage-return frames in
the middle of the JSON log lines (``service.logs`` writes JSON lines exactly when stderr is
not a terminal). ``quiet_progress_bars()`` turns both off there for the duration of a load
and puts them back as they were.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_progress_bars(stream: object = None) -> Iterator[bool]:
    """Within it, transformers draws no progress bar unless `stream` (None: sys.stderr) is a
    terminal. Yields whether the bars were turned off. Restores both on exit. Where
    transformers moves these bars elsewhere this does nothing (a load shows them again),
    and never fails a load."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        yield False
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield True
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
