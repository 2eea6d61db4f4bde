"""Conveyor's server side: the in-process Engine, its configs, and the WebSocket server.

    from service import Engine, EngineConfig
"""

from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from service.engine import Engine

__all__ = ["CacheConfig", "Engine", "EngineConfig", "ModelConfig", "SchedulerConfig",
           "ServerConfig"]
