"""The real model's start-up report (issue 23, item 4): the engine_ready line and /metrics
count the linear layers per weight format, LM head included (SmolLM2-135M: 30 decoder
layers x 4 + 1)."""

from __future__ import annotations

import pytest
import structlog

from service.engine import Engine
from tests.integration.conftest import engine_config

pytestmark = pytest.mark.model


async def test_engine_ready_and_metrics_count_linear_layers_per_format(loaded_model):
    with structlog.testing.capture_logs() as logs:
        engine = await Engine(engine_config(), loaded=loaded_model).start()
    try:
        ready = next(e for e in logs if e["event"] == "engine_ready")
        layers = len(engine.runner.model.layers)
        assert ready["linear_layers"] == f"fp32={4 * layers + 1}"
        text = engine.metrics.render().decode()
        assert (f'conveyor:linear_layers{{format="fp32",model_name="{engine.model_name}"}} '
                f"{float(4 * layers + 1)}") in text
    finally:
        await engine.close()
