"""Lazy access to Triton, so that importing ``kernels`` never needs it.

``triton.jit`` decides at decoration time whether a kernel runs natively or
under the interpreter (``TRITON_INTERPRET=1``). Kernels in this package are
therefore plain functions at import time and are decorated on first launch,
once per interpreter setting, so an environment variable set after
``import kernels`` still takes effect.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is set to ``"1"`` in the environment."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _jit_cached(fn: Callable[..., Any], interpret: bool) -> Any:
    import triton

    return triton.jit(fn)


def jit(fn: Callable[..., Any]) -> Any:
    """Return ``triton.jit(fn)``, decorated for the current interpreter setting.

    Raises:
        ImportError: triton is not installed.
    """
    return _jit_cached(fn, interpret_enabled())


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
