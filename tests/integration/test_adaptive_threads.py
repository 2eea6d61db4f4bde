"""The model runner with the adaptive thread tuner: steps run with the count it asks for,
report their time back, and the text does not change with the count."""

from __future__ import annotations

import pytest
import torch

from service.worker.cpu_threads import default_num_threads
from service.engine.llm import LLM

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


def test_start_up_runs_the_first_probe_so_requests_do_not(loaded_model, monkeypatch) -> None:
    from service.bench.texts import PASSAGES

    llm = LLM(loaded=loaded_model, num_kv_blocks=64)
    runner, tuner = llm.runner, llm.runner.thread_tuner
    assert tuner is not None and not tuner.history and not tuner.probing
    runner.measure_rates(prefill_tokens=32)
    assert len(tuner.history) == 1 and not tuner.probing, "the probe ends within start-up"
    asked: list[int] = []
    ask = tuner.threads_for_next_step
    monkeypatch.setattr(tuner, "threads_for_next_step",
                        lambda tokens=None: asked.append(ask(tokens)) or asked[-1])
    ids = loaded_model.tokenizer.encode(PASSAGES[1], add_special_tokens=False)[:40]
    llm.generate_greedy([ids], 8)
    assert len(asked) == 8 and set(asked) == {tuner.current}, "no probe step in the request"
    assert len(tuner.history) == 1 and not tuner.probing
