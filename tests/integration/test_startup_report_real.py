"""The real model's start-up report (issue 23, item 4): the engine_ready line and /metrics
count the linear layers per weight format, LM head included (SmolLM2-135M: 30 decoder
layers x 4 + 1)."""

from __future__ import annotations

import re

import pytest
import structlog

from service.engine import Engine
from tests.integration.conftest import engine_config

pytestmark = pytest.mark.model


async def _ready_and_metrics(loaded_model, quantization):
    with structlog.testing.capture_logs() as logs:
        engine = await Engine(engine_config(quantization=quantization), loaded=loaded_model).start()
    try:
        ready = next(e for e in logs if e["event"] == "engine_ready")
        return (ready, len(engine.runner.model.layers), engine.model_name,
                engine.metrics.render().decode())
    finally:
        await engine.close()


async def test_unquantized_engine_counts_every_linear_layer_as_fp32(loaded_model):
    ready, layers, name, text = await _ready_and_metrics(loaded_model, None)
    assert ready["linear_layers"] == f"fp32={4 * layers + 1}"
    # the op backend under --attention-backend's name (not a "kernels" field that read as
    # contradicting decode_kernel)
    assert ready["attention_backend"] == "torch" and "kernels" not in ready
    assert (f'conveyor:linear_layers{{format="fp32",model_name="{name}"}} '
            f"{float(4 * layers + 1)}") in text


async def test_default_auto_engine_reports_the_gguf_formats_it_serves(loaded_model):
    """Under the default (auto: the GGUF's own Q4_1/Q8_0 blocks) the formats differ per
    machine, as the measured plan picks per row bucket; the counts still add up to every
    linear layer, one of them serves the checkpoint's own blocks, and /metrics agrees."""
    ready, layers, name, text = await _ready_and_metrics(loaded_model, "auto")
    counts = dict(item.split("=") for item in ready["linear_layers"].split())
    assert sum(int(n) for n in counts.values()) == 4 * layers + 1
    assert any(re.search(r"q4_1|q4_0|q8_0", fmt) for fmt in counts), counts
    for fmt, n in counts.items():
        assert (f'conveyor:linear_layers{{format="{fmt}",model_name="{name}"}} '
                f"{float(n)}") in text
