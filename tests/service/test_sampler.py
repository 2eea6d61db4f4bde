"""sample(): greedy, top-k/top-p/min-p masks, seeded batch invariance, sampled frequencies."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch

from service.worker.sampler import GREEDY_EPS, SamplingTensors, build_sampling_tensors, make_generator, sample


@dataclass(frozen=True)
class Params:
    """Stand-in for protocol.SamplingParams: the sampler only reads these attributes."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None


def run(
    logits: torch.Tensor, params: list[Params], generators: list[torch.Generator | None] | None = None
) -> torch.Tensor:
    tensors = build_sampling_tensors(params, logits.device)
    return sample(logits, *tensors, generators if generators is not None else [None] * len(params))


def repeat_rows(probs: list[float], n: int) -> torch.Tensor:
    """[n, V] logits whose softmax is `probs` in every row."""
    return torch.tensor(probs, dtype=torch.float32).log().expand(n, len(probs)).contiguous()


def counts(tokens: torch.Tensor, vocab: int) -> list[int]:
    return torch.bincount(tokens, minlength=vocab).tolist()


def chi_square(observed: list[int], expected_probs: list[float]) -> float:
    total = sum(observed)
    return sum((o - total * p) ** 2 / (total * p) for o, p in zip(observed, expected_probs) if p > 0)


# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


# -- greedy -----------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    assert torch.equal(run(logits, [Params(temperature=0.0)] * 6), logits.argmax(-1))
    # Greedy ignores the other knobs.
    assert torch.equal(run(logits, [Params(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)] * 6), logits.argmax(-1))


def test_the_all_greedy_hint_gives_the_same_tokens_and_fails_bad_rows_alone() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g)
    logits[1, 3] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, :] = 2.0  # ties: the lowest id
    tensors = build_sampling_tensors([Params(temperature=0.0, top_k=2)] * 5)
    plain = sample(logits, *tensors, [None] * 5)
    hinted = sample(logits, *tensors, [None] * 5, all_greedy=True)
    assert hinted.tolist() == plain.tolist()
    assert hinted[1] == -1 and hinted[3] == -1 and hinted[4] == 0


def test_greedy_ties_pick_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    assert run(logits, [Params(temperature=0.0)] * 2).tolist() == [1, 0]


def test_top_k_keeps_ties_at_the_cut() -> None:
    # As vLLM: every token tied with the k-th largest logit stays.
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [3.0, 2.0, 2.0, 0.0]]).repeat(500, 1)
    tokens = run(logits, [Params(top_k=1), Params(top_k=2)] * 500).view(500, 2)
    assert set(tokens[:, 0].tolist()) == {1, 3}
    assert set(tokens[:, 1].tolist()) == {0, 1, 2}


def test_top_k_1_equals_greedy() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        logits = torch.randn(8, 300, generator=g) * 3
        assert torch.equal(run(logits, [Params(temperature=1.3, top_k=1)] * 8), logits.argmax(-1))


def test_greedy_rows_inside_a_sampled_batch() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 100, generator=g)
    params = [
        Params(temperature=0.0),
        Params(temperature=2.0),
        Params(temperature=GREEDY_EPS / 2),
        Params(top_p=0.5),
    ]
    out = run(logits, params)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out.dtype == torch.int64 and out.shape == (4,)


# -- masks --------------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (Params(top_k=2), {0, 1}),
        (Params(top_k=3), {0, 1, 2}),
        (Params(top_p=0.3), {0}),
        (Params(top_p=0.75), {0, 1}),  # mass before token 2 is 0.8 >= 0.75
        (Params(top_p=0.85), {0, 1, 2}),
        (Params(min_p=0.2), {0, 1, 2}),  # threshold 0.1
        (Params(min_p=0.5), {0, 1}),  # threshold 0.25
        (Params(top_k=3, top_p=0.7), {0, 1}),  # after top-k: [.526, .316, .158], mass before [0, .526, .842]
        (Params(top_p=0.85, min_p=0.4), {0, 1}),
        (Params(top_p=0.65), {0, 1}),
        (Params(temperature=0.5, top_p=0.65), {0}),  # temperature first: [.685, .247, .062, .007]
    ],
)
def test_masks_never_draw_outside_the_allowed_set(params: Params, allowed: set[int]) -> None:
    torch.manual_seed(3)
    tokens = run(repeat_rows(PROBS, 4000), [params] * 4000)
    seen = {i for i, c in enumerate(counts(tokens, 4)) if c}
    assert seen == allowed


def test_rows_with_different_masks_in_one_batch() -> None:
    torch.manual_seed(4)
    params = [Params(top_k=1), Params(), Params(top_p=0.75), Params(min_p=0.5), Params(top_k=3)]
    n = 1000
    logits = repeat_rows(PROBS, n * len(params))
    tokens = run(logits, [p for p in params for _ in range(n)]).view(len(params), n)
    seen = [set(row.tolist()) for row in tokens]
    assert seen == [{0}, {0, 1, 2, 3}, {0, 1}, {0, 1}, {0, 1, 2}]


def _reference_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[V] bool: the smallest most-likely set with mass >= top_p, plus ties of its last token."""
    ordered = probs.sort(descending=True).values
    mass_before = ordered.cumsum(0) - ordered
    last = ordered[int((mass_before < top_p).sum()) - 1]
    return probs >= last


def test_top_p_matches_a_full_sort_for_narrow_and_wide_nuclei() -> None:
    from service.worker.sampler import TOP_P_CANDIDATES, _mask_top_p_

    gen = torch.Generator().manual_seed(8)
    vocab = 3000
    # Peaked rows fit in the candidates; flat rows need far more tokens than that.
    scales = torch.tensor([8.0, 4.0, 0.05, 0.01, 2.0, 0.02])
    probs = torch.softmax(torch.randn(len(scales), vocab, generator=gen) * scales.unsqueeze(1), dim=-1)
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.3, 0.99, 0.6])
    kept = _mask_top_p_(probs.clone(), top_p) > 0
    sizes = kept.sum(-1).tolist()
    assert min(sizes) < TOP_P_CANDIDATES < max(sizes)
    for row in range(len(scales)):
        assert torch.equal(kept[row], _reference_nucleus(probs[row], float(top_p[row])))


def test_top_p_boundary_is_the_smallest_set_reaching_top_p() -> None:
    from service.worker.sampler import _mask_top_p_

    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3)  # exact in binary
    kept = _mask_top_p_(probs.clone(), torch.tensor([0.75, 0.5, 0.76])) > 0
    # Mass 0.75 is reached by {0, 1} exactly; 0.5 by {0}; 0.76 needs token 2 and its tie 3.
    assert kept.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]


def test_wide_nucleus_through_sample() -> None:
    torch.manual_seed(9)
    vocab = 2000
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-3).expand(3000, vocab)
    allowed = _reference_nucleus(torch.softmax(logits[0], -1), 0.5)
    tokens = run(logits, [Params(top_p=0.5)] * 3000)
    assert bool(allowed[tokens].all())
    assert int(tokens.max()) > 256 and not bool(allowed[-1])


# -- frequencies --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (Params(temperature=1.0), PROBS),
        # T = 2: p ** (1/2), renormalised.
        (Params(temperature=2.0), [p**0.5 / sum(q**0.5 for q in PROBS) for p in PROBS]),
        (Params(temperature=0.5), [p**2 / sum(q**2 for q in PROBS) for p in PROBS]),
        (Params(top_k=3, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (Params(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ],
)
def test_sampled_frequencies_match_the_distribution(params: Params, expected: list[float]) -> None:
    torch.manual_seed(5)
    n = 20000
    observed = counts(run(repeat_rows(PROBS, n), [params] * n), 4)
    df = sum(1 for p in expected if p > 0) - 1
    assert all(o == 0 for o, p in zip(observed, expected) if p == 0)
    assert chi_square(observed, expected) < CHI2_999[df], (observed, expected)


def test_seeded_row_frequencies_over_steps() -> None:
    # One seeded row sampled step after step follows the distribution too.
    gen = make_generator(1234)
    logits = repeat_rows(PROBS, 1)
    tokens = torch.cat([run(logits, [Params(temperature=1.0)], [gen]) for _ in range(3000)])
    assert chi_square(counts(tokens, 4), PROBS) < CHI2_999[3]


# -- seeds --------------------------------------------------------------------------


def _seeded_sequence(position: int, batch: int, steps: int = 15, vocab: int = 500) -> list[int]:
    """Tokens of the request seeded with 42 (top_p 0.9, T 0.8) at row `position` of a batch."""
    logits_gen = torch.Generator().manual_seed(99)  # the request's logits, the same in every scenario
    other_gen = torch.Generator().manual_seed(position * 1000 + batch)  # its neighbours differ per scenario
    mine = Params(temperature=0.8, top_p=0.9, seed=42)
    neighbours = [Params(temperature=1.0), Params(temperature=0.0), Params(top_k=5, seed=7), Params(min_p=0.1)]
    generators: list[torch.Generator | None] = []
    params: list[Params] = []
    for row in range(batch):
        p = mine if row == position else neighbours[row % len(neighbours)]
        params.append(p)
        generators.append(make_generator(p.seed))
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=other_gen) * 2
        logits[position] = torch.randn(vocab, generator=logits_gen) * 2
        out.append(int(run(logits, params, generators)[position]))
    return out


def test_seeded_row_is_batch_invariant() -> None:
    alone = _seeded_sequence(position=0, batch=1)
    assert len(set(alone)) > 3  # it really samples
    assert _seeded_sequence(position=2, batch=4) == alone
    assert _seeded_sequence(position=5, batch=7) == alone
    assert _seeded_sequence(position=0, batch=3) == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is the noise's doing

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [int(run(logits, [Params()], [gen])) for _ in range(10)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert make_generator(None) is None
    assert draw(-1) == draw(2**64 - 1)  # seeds are taken modulo 2**64


def test_unseeded_rows_follow_the_default_generator() -> None:
    logits = torch.zeros(3, 1000)
    torch.manual_seed(6)
    first = run(logits, [Params()] * 3)
    torch.manual_seed(6)
    assert torch.equal(run(logits, [Params()] * 3), first)


# -- input checks -------------------------------------------------------------------


def test_build_rejects_out_of_range_params() -> None:
    for bad, field in [
        (Params(temperature=-0.1), "temperature"),
        (Params(temperature=math.inf), "temperature"),
        (Params(top_p=0.0), "top_p"),
        (Params(top_p=1.5), "top_p"),
        (Params(top_k=-1), "top_k"),
        (Params(min_p=1.1), "min_p"),
        (Params(min_p=math.nan), "min_p"),
    ]:
        with pytest.raises(ValueError, match=f"row 1: {field}"):
            build_sampling_tensors([Params(), bad])


def test_build_makes_the_documented_tensors() -> None:
    t = build_sampling_tensors([Params(temperature=0.5, top_p=0.9, top_k=4, min_p=0.1), Params()])
    assert isinstance(t, SamplingTensors)
    assert [x.dtype for x in t] == [torch.float32, torch.float32, torch.int64, torch.float32]
    assert t.top_k.tolist() == [4, 0] and t.temperature.tolist() == [0.5, 1.0]


def test_sample_rejects_bad_shapes() -> None:
    t = build_sampling_tensors([Params()] * 2)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 3, 4), *t, [None, None])
    with pytest.raises(ValueError, match="top_p must be"):
        sample(torch.zeros(2, 5), t.temperature, t.top_p[:1], t.top_k, t.min_p, [None, None])
    with pytest.raises(ValueError, match="generators"):
        sample(torch.zeros(2, 5), *t, [None])
    with pytest.raises(TypeError, match="float"):
        sample(torch.zeros(2, 5, dtype=torch.int64), *t, [None, None])


# -- cost ---------------------------------------------------------------------------


def test_cost_report() -> None:
    """Benchmark-style print (run with -s); checks results, never the time."""
    vocab = 49152
    cases = {
        "greedy": Params(temperature=0.0),
        "temperature": Params(temperature=0.8),
        "top_p+top_k": Params(temperature=0.8, top_p=0.9, top_k=50),
        "seeded": Params(temperature=0.8, seed=1),
    }
    for batch in (8, 64):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(7))
        for name, p in cases.items():
            gens = [make_generator(p.seed) for _ in range(batch)]
            tensors = build_sampling_tensors([p] * batch)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                out = sample(logits, *tensors, gens)
                best = min(best, time.perf_counter() - t0)
            assert out.shape == (batch,) and bool(((out >= 0) & (out < vocab)).all())
            print(f"\nsample B={batch} V={vocab} {name}: {best * 1e3:.2f} ms")


# ---- log-probabilities ------------------------------------------------------------------

def test_logprobs_are_the_raw_distribution_whatever_the_sampling_params() -> None:
    from service.worker.sampler import compute_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    tokens = torch.tensor([7, 0, 49])
    out = compute_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(out.token.double(), ref[torch.arange(3), tokens], atol=1e-5)
    want_top, want_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, want_ids)
    assert torch.allclose(out.top.double(), want_top, atol=1e-5)
    assert (out.top[:, :-1] >= out.top[:, 1:]).all()  # most likely first
    # a temperature or a cut would change them: these are the model's own (vLLM's default)
    hot = compute_logprobs(logits / 0.5, tokens, 5)
    assert not torch.allclose(hot.token, out.token)
    assert out.top.exp().sum(-1).lt(1.0 + 1e-6).all() and out.token.le(0).all()


def test_logprobs_of_half_logits_in_float32_and_edge_cases() -> None:
    from service.worker.sampler import compute_logprobs

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    out = compute_logprobs(logits, torch.tensor([2, -1]), 0)
    assert out.token.dtype == torch.float32 and out.top.shape == (2, 0)
    assert out.top_ids.shape == (2, 0) and out.top_ids.dtype == torch.int64
    assert abs(out.token[0].item() - math.log(0.25)) < 1e-6
    assert out.token[1].item() > -1e-3  # a failed row (-1) reads as id 0, never an index error
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.tensor([0, 0]), 5)
    with pytest.raises(ValueError, match="tokens"):
        compute_logprobs(logits, torch.tensor([0]), 1)
