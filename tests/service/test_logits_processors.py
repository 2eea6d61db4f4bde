"""Per-row logits processors (min_tokens, logit_bias, penalties) against a plain reference.

The reference works one row and one token at a time, straight from the definitions
(OpenAI's presence / frequency formula, CTRL's repetition penalty as transformers and vLLM
apply it, vLLM's min_tokens); the batched code must give the same floats, touch no other
row, and give a row the same result whatever its neighbours.
"""

from __future__ import annotations

import math

import pytest
import torch

from protocol import SamplingParams
from service.core.request import Request, uses_logits_processors
from service.worker.logits_processors import (RowHistory, apply_logits_processors,
                                              needs_processing, plan_logits_processing)
from service.worker.sampler import build_sampling_tensors, greedy_tokens, sample

VOCAB = 50
EOS = (2, 7)


def reference(logits: list[float], params: SamplingParams, prompt: list[int],
              output: list[int]) -> list[float]:
    """One row, token by token, in vLLM's order: min_tokens, logit_bias, penalties."""
    out = list(logits)
    if len(output) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(EOS))
        for t in stops:
            out[t] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    rep = params.repetition_penalty or 1.0
    for t in range(len(out)):
        n = output.count(t)
        if rep != 1.0 and (n or t in prompt):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= params.frequency_penalty * n
        if n:
            out[t] -= params.presence_penalty
    return out


def run(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], list[int]]]
        ) -> torch.Tensor:
    """The batched processors on a copy of `logits`, every row given its history."""
    histories = [RowHistory(i, out, torch.tensor(prompt, dtype=torch.int64), p)
                 for i, (p, prompt, out) in enumerate(rows) if needs_processing(p)]
    result = logits.clone()
    plan = plan_logits_processing(histories, EOS, VOCAB)
    if plan is not None:
        apply_logits_processors(result, plan)
    return result


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias={3: 5.0, 11: -100.0, 49: 0.25}),
    SamplingParams(min_tokens=4),
    SamplingParams(min_tokens=4, stop_token_ids=(9, 13)),
    SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=(9,)),
    SamplingParams(min_tokens=2),  # already reached: nothing masked
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                   logit_bias={5: 2.0}, min_tokens=10),
]


@pytest.mark.parametrize("params", CASES)
def test_each_processor_matches_the_reference(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=g) * 4
    prompt, output = [1, 4, 4, 20, 33], [5, 3, 5, 5]
    got = run(logits, [(params, prompt, output)])[0].tolist()
    want = reference(logits[0].tolist(), params, prompt, output)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert [math.isinf(x) for x in got] == [math.isinf(x) for x in want]


def test_a_mixed_batch_matches_row_by_row_and_leaves_other_rows_alone() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(CASES) + 2, VOCAB, generator=g) * 3
    rows = [(p, [i, i + 1, 40], [i % 7, 3, 3, 8][: i % 5]) for i, p in enumerate(CASES)]
    rows += [(SamplingParams(), [1], [1, 2]), (SamplingParams(temperature=0.5), [], [9])]
    got = run(logits, rows)
    for i, (p, prompt, out) in enumerate(rows):
        assert got[i].tolist() == pytest.approx(reference(logits[i].tolist(), p, prompt, out),
                                                rel=1e-6, abs=1e-6)
    assert torch.equal(got[-2:], logits[-2:])  # bitwise untouched


def test_a_rows_result_does_not_depend_on_its_neighbours() -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, VOCAB, generator=g)
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, logit_bias={2: 1.0})
    alone = run(row, [(params, [1, 2], [3, 3])])
    others = torch.randn(5, VOCAB, generator=g)
    batch = torch.cat([others[:3], row, others[3:]])
    rows = [(SamplingParams(presence_penalty=2.0), [4], [4, 4])] * 3 + \
        [(params, [1, 2], [3, 3])] + [(SamplingParams(min_tokens=3), [], [])] * 2
    assert torch.equal(run(batch, rows)[3], alone[0])  # bit for bit


def test_min_tokens_keeps_greedy_and_sampling_off_the_stop_tokens() -> None:
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 2] = 10.0  # EOS by far the most likely
    logits[:, 9] = 9.0  # a stop token next
    rows = [(SamplingParams(min_tokens=1, stop_token_ids=(9,)), [1], []),
            (SamplingParams(), [1], [])]
    processed = run(logits, rows)
    assert greedy_tokens(processed).tolist()[0] not in (2, 7, 9)
    assert greedy_tokens(processed).tolist()[1] == 2
    params = [SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=(9,))] * 2
    tensors = build_sampling_tensors(params)
    for _ in range(20):
        drawn = sample(processed[:1].expand(2, VOCAB).contiguous(), *tensors, [None, None])
        assert not set(drawn.tolist()) & {2, 7, 9}


def test_logit_bias_of_100_forces_the_token() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, VOCAB, generator=g)
    processed = run(logits, [(SamplingParams(logit_bias={17: 100.0}), [0], [])])
    assert greedy_tokens(processed).tolist() == [17]


def test_penalties_lower_repeated_tokens_and_zero_penalties_change_nothing() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (VOCAB - 4)])
    out = run(logits, [(SamplingParams(repetition_penalty=2.0), [0], [1])])[0]
    assert out[0].item() == 1.0 and out[1].item() == -4.0 and out[2].item() == 1.0
    same = run(logits, [(SamplingParams(repetition_penalty=1.0, presence_penalty=0.0), [0], [1])])
    assert torch.equal(same, logits)


def test_which_requests_carry_their_token_history() -> None:
    assert not uses_logits_processors(SamplingParams())
    assert not uses_logits_processors(SamplingParams(repetition_penalty=1.0))
    for p in CASES[:-2] + CASES[-1:]:
        assert uses_logits_processors(p) and needs_processing(p)
    req = Request("r", [1, 2], SamplingParams(frequency_penalty=0.5))
    req.output_token_ids.append(9)
    assert req.token_history == ([1, 2], [9])  # the request's own lists
    assert Request("q", [1], SamplingParams()).token_history is None
