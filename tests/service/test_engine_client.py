"""The EngineClient contract: the in-process Engine honours it (model-free runner), and
`LLM` shares its admission (the whole-KV-pool fit check)."""

from __future__ import annotations

import time

import pytest

from protocol import ContextLengthExceeded, InvalidRequest
from service.core.config import CacheConfig, EngineConfig, SchedulerConfig
from service.engine import Engine
from service.engine.llm import LLM
from tests.service.engine_client_checks import check_engine_client
from tests.support.tiny_model import TinyRunner


async def test_engine_honours_the_engine_client_contract():
    cfg = EngineConfig(cache=CacheConfig(block_size=4),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64))
    engine = await Engine(cfg, runner=TinyRunner(num_blocks=256)).start()
    try:
        await check_engine_client(engine)
    finally:
        await engine.close()
    engine.core.check_integrity()
    assert engine.core.scheduler.pool.usage == 0.0


def test_llm_refuses_a_request_larger_than_the_whole_kv_pool_at_once():
    cfg = EngineConfig(cache=CacheConfig(num_kv_blocks=4, block_size=16))
    llm = LLM(config=cfg, runner=TinyRunner(num_blocks=4))
    t0 = time.monotonic()
    with pytest.raises(ContextLengthExceeded, match="KV blocks") as big:
        llm.generate([[1 + i % 200 for i in range(300)]], {"max_tokens": 4})
    assert time.monotonic() - t0 < 5
    assert big.value.prompt_alone  # 300 tokens need 19 of the 4 blocks by themselves
    with pytest.raises(ContextLengthExceeded, match="KV blocks") as long_output:
        llm.generate([[1, 2, 3]], {"max_tokens": 100})
    assert not long_output.value.prompt_alone and \
        long_output.value.param == "$.params.max_tokens"
    with pytest.raises(InvalidRequest) as e:
        llm.generate([[1, 2]], {"temperature": -1})
    assert e.value.param == "$.params.temperature"
    assert llm.generate([[1, 2, 3]], {"max_tokens": 3, "temperature": 0})[0] != []
