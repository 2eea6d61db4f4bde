"""The model runner with the adaptive thread tuner: steps run with the count it asks for,
report their time back, and the text does not change with the count."""

from __future__ import annotations

import pytest
import torch

from service.worker.cpu_threads import default_num_threads
from service.llm import LLM

pytestmark = pytest.mark.skipif(default_num_threads() < 2,
                                reason="one CPU: nothing for the tuner to choose")


def test_tuned_runner_probes_and_writes_the_same_tokens(loaded_model, monkeypatch) -> None:
    from service.bench.texts import PASSAGES

    ids = loaded_model.tokenizer.encode(PASSAGES[1], add_special_tokens=False)
    prompts = [ids[:40], ids[40:75], ids[75:130]]
    tuned = LLM(loaded=loaded_model, num_kv_blocks=64)
    tuner = tuned.runner.thread_tuner
    assert tuner is not None and tuner.max_threads == default_num_threads()
    asked: list[int] = []
    ask = tuner.threads_for_next_step
    monkeypatch.setattr(tuner, "threads_for_next_step",
                        lambda tokens=None: asked.append(ask(tokens)) or asked[-1])
    set_threads = torch.set_num_threads
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), set_threads(n)))
    out = tuned.generate_greedy(prompts, 24)
    monkeypatch.undo()
    assert tuner.history, "the first steps probe one thread fewer"
    assert 1 in asked and 1 in seen and set(seen) <= set(asked)
    pinned = LLM(loaded=loaded_model, num_kv_blocks=64)
    pinned.runner.thread_tuner = None
    torch.set_num_threads(default_num_threads())
    assert pinned.generate_greedy(prompts, 24) == out
