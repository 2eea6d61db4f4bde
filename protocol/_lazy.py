"""A package face that imports its members on first use (PEP 562 module __getattr__)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_face(namespace: dict[str, Any], exports: dict[str, str]
              ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for a package whose `namespace` (its globals()) should offer
    `exports` (name -> defining module), each imported on first access and then cached."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
