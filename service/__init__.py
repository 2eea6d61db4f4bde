"""Conveyor's server side: the in-process Engine, its configs, and the WebSocket server.

    from service import Engine, EngineConfig

A lazy face: importing `service` (or `service.core`) loads neither torch nor the
engine; `service.Engine` and the configs are imported on first use.
"""

from __future__ import annotations

from protocol._lazy import lazy_face

_EXPORTS = {
    "CacheConfig": "service.config",
    "EngineConfig": "service.config",
    "ModelConfig": "service.config",
    "SchedulerConfig": "service.config",
    "ServerConfig": "service.config",
    "Engine": "service.engine.engine",
    "EngineRequest": "service.engine.client",
    "LLM": "service.engine.llm",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
