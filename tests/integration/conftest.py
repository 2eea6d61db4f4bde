"""Fixtures for tests that run the real model: small engines sharing one loaded checkpoint."""

from __future__ import annotations

import pytest

from service.config import CacheConfig, EngineConfig, SchedulerConfig
from service.engine import Engine



def engine_config(*, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                  num_kv_blocks: int | None = 512, block_size: int = 16,
                  enable_prefix_caching: bool = True, attention_backend: str = "auto",
                  max_waiting_requests: int = 1024, preemption_mode: str = "auto",
                  swap_space: float = 0.25, watermarks: tuple[float, float, float] = (0.7, 0.9, 0.95),
                  scheduling_policy: str = "fcfs", batching: str = "continuous",
                  quantization: str | None = "auto", kv_disk_path: str | None = None,
                  kv_disk_size: int = 1 << 30, kv_cache_dtype: str = "auto",
                  served_model_name: str | None = None) -> EngineConfig:
    from service.config import ModelConfig

    return EngineConfig(
        model=ModelConfig(attention_backend=attention_backend, quantization=quantization,
                          served_model_name=served_model_name),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=enable_prefix_caching, swap_space=swap_space,
                          kv_watermark_low=watermarks[0], kv_watermark_high=watermarks[1],
                          kv_watermark_critical=watermarks[2], kv_disk_path=kv_disk_path,
                          kv_disk_size=kv_disk_size, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_waiting_requests=max_waiting_requests,
                                  preemption_mode=preemption_mode,
                                  scheduling_policy=scheduling_policy, batching=batching),
    )


@pytest.fixture
async def make_engine(loaded_model, served_model):
    """Factory: `await make_engine(**engine_config kwargs)` -> a started Engine, closed after the
    test; its block pool must pass check_integrity() with no block held at the end. The auto
    modes serve the file's blocks (as `conveyor serve` does), the others dense weights."""
    engines: list[Engine] = []

    async def make(**kw) -> Engine:
        auto = kw.get("quantization", "auto") in ("auto", "auto-a8")
        engine = await Engine(engine_config(**kw),
                              loaded=served_model if auto else loaded_model).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()
        engine.scheduler.check_integrity()
        assert engine.scheduler.pool.usage == 0.0, "KV blocks leaked"


@pytest.fixture
def small_config():
    return engine_config


@pytest.fixture
async def make_server(make_engine):
    """Factory: `await make_server(**engine kwargs)` -> (engine, server) on 127.0.0.1, port 0."""
    from service.config import ServerConfig
    from service.front.server import FrontServer

    servers: list[FrontServer] = []

    async def make(server_config: ServerConfig | None = None, **kw):
        engine = await make_engine(**kw)
        server = await FrontServer(engine, server_config or ServerConfig(port=0)).start()
        servers.append(server)
        return engine, server

    yield make
    for server in servers:
        await server.close()
