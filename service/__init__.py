"""Conveyor's server side: the in-process Engine, its configs, and the WebSocket server.

    from service import Engine, EngineConfig

A lazy face: importing `service` (or `service.core`) loads neither torch nor the
engine; `service.Engine` and the configs are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CacheConfig": "service.config",
    "EngineConfig": "service.config",
    "ModelConfig": "service.config",
    "SchedulerConfig": "service.config",
    "ServerConfig": "service.config",
    "Engine": "service.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'service' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
