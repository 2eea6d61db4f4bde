"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Semantics follow vLLM's sampler: a temperature below `GREEDY_EPS` (0 on the
wire) is greedy (argmax; ties -> lowest id, as `torch.argmax`); otherwise the
logits are divided by the temperature, then top-k, top-p (nucleus sampling,
Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020)
and min-p (Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024) remove
tokens, and one token is drawn from the softmax of what is left.

Drawing uses the exponential race: with E_i ~ Exponential(1) i.i.d.,
argmax_i p_i / E_i is distributed as p (it is the Gumbel-max trick,
-log E_i being Gumbel noise); E_i = -log U_i with U_i ~ Uniform[0, 1). Each
row needs exactly V uniform draws per step, whatever its parameters (the
top-k/top-p cuts use no randomness), so a row with its own `torch.Generator` draws them
from that generator alone: a seeded request gets the same tokens whatever
else is in the batch and wherever its row sits. Rows without a generator share
one draw from the default generator of the logits' device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "GREEDY_EPS",
    "SamplingParamsLike",
    "SamplingTensors",
    "TokenLogprobs",
    "build_sampling_tensors",
    "compute_logprobs",
    "make_generator",
    "sample",
]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS); also keeps
# logits / temperature finite.
GREEDY_EPS = 1e-5


class SamplingParamsLike(Protocol):
    """What the sampler reads from a request's params (`protocol.SamplingParams` has it);
    None means the neutral value (temperature 1, top_p 1, top_k 0, min_p 0)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters of a batch, each [B], on the logits' device.

    temperature: float32, >= 0 (< GREEDY_EPS means greedy).
    top_p: float32 in (0, 1] (1 = off).
    top_k: int64 >= 0 (0 = off).
    min_p: float32 in [0, 1] (0 = off).
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor


def check_sampling_params(params: Sequence[SamplingParamsLike]) -> None:
    """Validate per-request params as `build_sampling_tensors` does, without building tensors
    (an all-greedy step needs none). Raises ValueError as it does."""
    _sampling_lists(params)


def build_sampling_tensors(
    params: Sequence[SamplingParamsLike], device: torch.device | str = "cpu"
) -> SamplingTensors:
    """Stack per-request params into `SamplingTensors` for `sample(logits, *tensors, generators)`.

    params: one object per logits row with attributes temperature, top_p, top_k, min_p.
    Raises ValueError (naming the row and field) for a value outside its range:
    temperature >= 0, top_p in (0, 1], top_k >= 0, min_p in [0, 1], all finite.
    """
    temperature, top_p, top_k, min_p = _sampling_lists(params)
    return SamplingTensors(
        torch.tensor(temperature, dtype=torch.float32, device=device),
        torch.tensor(top_p, dtype=torch.float32, device=device),
        torch.tensor(top_k, dtype=torch.int64, device=device),
        torch.tensor(min_p, dtype=torch.float32, device=device),
    )


def _sampling_lists(
    params: Sequence[SamplingParamsLike],
) -> tuple[list[float], list[float], list[int], list[float]]:
    temperature: list[float] = []
    top_p: list[float] = []
    top_k: list[int] = []
    min_p: list[float] = []
    for row, p in enumerate(params):
        # None (unset) is the neutral value; the engine fills unset values from the model's
        # generation config at admission, so only direct callers ever pass None here.
        t = 1.0 if p.temperature is None else float(p.temperature)
        tp = 1.0 if p.top_p is None else float(p.top_p)
        tk = 0 if p.top_k is None else p.top_k
        mp = 0.0 if p.min_p is None else float(p.min_p)
        if not 0.0 <= t < float("inf"):
            raise ValueError(f"row {row}: temperature must be a finite float >= 0, got {p.temperature!r}")
        if not 0.0 < tp <= 1.0:
            raise ValueError(f"row {row}: top_p must be in (0, 1], got {p.top_p!r}")
        if isinstance(tk, bool) or not isinstance(tk, int) or tk < 0:
            raise ValueError(f"row {row}: top_k must be an int >= 0, got {p.top_k!r}")
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"row {row}: min_p must be in [0, 1], got {p.min_p!r}")
        temperature.append(t)
        # keep values representable: a top_p below float32's range would round to 0 (keep the
        # top token instead, which is what any tiny nucleus means); top_k >= 2**31 means "off"
        top_p.append(max(tp, 1e-6))
        top_k.append(min(tk, (1 << 31) - 1))
        min_p.append(mp)
    return temperature, top_p, top_k, min_p


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's own generator seeded with `seed` (taken modulo 2**64), or None without a seed.

    Keep it with the request for its whole life: its state advances every step.
    A CPU generator works for logits on any device (its noise is drawn on the CPU
    and copied), and then gives the same noise on every machine.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    min_p: Tensor,
    generators: Sequence[torch.Generator | None],
    *,
    all_greedy: bool = False,
) -> Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] float (float32 preferred; others are upcast), not modified.
        temperature, top_p, min_p: [B] float32; top_k: [B] int64 (see `SamplingTensors`;
            `build_sampling_tensors` validates their values, this function does not, to
            avoid device syncs).
        generators: B entries; a row's own generator (any device) or None for the
            default generator of the logits' device. A seeded row draws V values
            from its generator in every step that is not all-greedy (a greedy row's
            tokens never depend on them).
        all_greedy: the caller knows every row is greedy (every temperature below
            GREEDY_EPS): one max over the rows, none of the branch decisions and their
            device sync (0.33 against 0.08 ms for one row of 49,152 on one AVX2 thread).
            The tokens are the same as without it.

    Returns: [B] int64 token ids on the logits' device; -1 for a row whose logits hold
        NaN or +inf (that row's failure only: every other row is sampled as usual).

    Raises: ValueError on a shape mismatch, TypeError on a non-float logits tensor.

    Tokens tied with the last one a top-k or top-p cut keeps are kept too (as in
    vLLM's top-k), so the result never depends on how a sort orders equal values.

    Cost: one argmax for an all-greedy batch; no full sort of the vocabulary: top-k
    is a `topk` of the largest k asked for, top-p a `topk` of a few hundred
    candidates (a full sort only for rows whose nucleus is wider), both on the rows
    that ask for them only; one softmax and one uniform draw over [B, V].
    """
    _check_inputs(logits, temperature, top_p, top_k, min_p, generators)
    if all_greedy:
        return greedy_tokens(logits)
    batch, vocab = logits.shape
    logits = logits.float()
    greedy = temperature < GREEDY_EPS  # [B]
    # -1 marks a row with NaN or +inf logits, which fails alone instead of sampling garbage
    argmax = greedy_tokens(logits)  # [B]
    needs_top_k = ~greedy & (top_k > 0) & (top_k < vocab)  # [B]
    needs_top_p = ~greedy & (top_p < 1.0)  # [B]
    needs_min_p = ~greedy & (min_p > 0.0)  # [B]
    # One device sync for all the branch decisions.
    flags = torch.stack(
        [
            greedy.all(),
            needs_top_k.any(),
            needs_top_k.all(),
            needs_top_p.any(),
            needs_top_p.all(),
            needs_min_p.any(),
            torch.where(needs_top_k, top_k, 0).max(),
        ]
    )
    all_greedy, any_top_k, all_top_k, any_top_p, all_top_p, any_min_p, max_top_k = flags.tolist()
    if all_greedy:
        return argmax

    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)  # [B, V]
    if all_top_k:
        _mask_top_k_(scaled, top_k, max_top_k)
    elif any_top_k:
        rows = needs_top_k.nonzero().squeeze(1)  # [S]
        scaled[rows] = _mask_top_k_(scaled[rows], top_k[rows], max_top_k)
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    # From here on rows are not renormalised after a cut: argmax(p / E) below
    # does not change when a row is scaled.
    if all_top_p:
        _mask_top_p_(probs, top_p)
    elif any_top_p:
        rows = needs_top_p.nonzero().squeeze(1)  # [S]
        probs[rows] = _mask_top_p_(probs[rows], top_p[rows])
    if any_min_p:
        # Drop tokens less likely than min_p times the most likely one. The ratio
        # p_i / p_max does not change under renormalisation, so this is min-p on
        # the distribution left by top-k and top-p.
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs.masked_fill_(probs < threshold, 0.0)

    # Exponential race: argmax p_i / E_i with E_i = -log U_i, computed as
    # argmin p_i / log U_i (one pass fewer; log U_i < 0, and a dropped token's
    # 0 / log U_i = 0 is above every kept token's negative value).
    log_uniform = _log_uniform_noise(batch, vocab, generators, logits.device)  # [B, V]
    sampled = probs.div_(log_uniform).argmin(dim=-1)  # [B]
    return torch.where(greedy | (argmax < 0), argmax, sampled)


def greedy_tokens(logits: Tensor) -> Tensor:
    """[B] int64: each row's argmax (the first one among ties), -1 for a row whose logits hold
    NaN or +inf (or are all -inf). logits: [B, V] float.

    fp32 rows on the CPU go through `kernels.row_argmax_cpu` where it builds (torch's max
    along the last dim is scalar there: 0.13 against 0.02 ms for one row of 49,152, 1.0
    against 0.10 ms for 16, on the 2-core AVX2 reference machine); the same tokens.
    """
    if logits.device.type == "cpu":
        from kernels.row_argmax_cpu import row_argmax, supports

        if supports(logits) and _argmax_kernel_builds():  # the cheap check first
            return row_argmax(logits)
    top, tokens = logits.max(dim=-1)  # [B], [B]
    return tokens.masked_fill_(~torch.isfinite(top), -1)


@functools.cache
def _argmax_kernel_builds() -> bool:
    from kernels.row_argmax_cpu import build_problem

    return build_problem() is None


class TokenLogprobs(NamedTuple):
    """Log-probabilities (natural log, float32) of S rows.

    token: [S] of the token each row chose (sampled, or the prompt's next token).
    top_ids: [S, K] int64, the K most likely tokens, most likely first (equal values in
        no promised order).
    top: [S, K] their log-probabilities, descending.
    """

    token: Tensor
    top_ids: Tensor
    top: Tensor


def compute_logprobs(logits: Tensor, tokens: Tensor, num_top: int) -> TokenLogprobs:
    """Log-probabilities of `tokens` and of each row's `num_top` most likely tokens.

    Which distribution: the model's own, log_softmax of the raw logits in float32,
    before temperature, top-k, top-p and min-p (vLLM's default, its "raw_logprobs"
    mode). So a text's score depends on the model only, never on the sampling settings
    of the request that asked (lm-eval's loglikelihood tasks rely on that), and a greedy
    request gets the same numbers as a sampled one; a sampled token that a cut made
    certain still shows its probability under the model.

    Args:
        logits: [S, V] float, only the rows that ask (callers slice them: rows that ask
            for nothing cost nothing), not modified.
        tokens: [S] int64 ids in [0, V) (a negative id, a failed row, reads as id 0).
        num_top: K in [0, V].

    Cost: one log_softmax over [S, V], one gather, one topk of K (none when K is 0).
    """
    if logits.dim() != 2 or tokens.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [S, V] and tokens [S], got {tuple(logits.shape)} "
                         f"and {tuple(tokens.shape)}")
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    token = logp.gather(1, tokens.clamp_min(0).unsqueeze(1)).squeeze(1)  # [S]
    if num_top == 0:
        empty = logp.new_empty((logp.shape[0], 0))
        return TokenLogprobs(token, empty.long(), empty)
    top, top_ids = logp.topk(num_top, dim=-1)  # [S, K], descending
    return TokenLogprobs(token, top_ids, top)


# Top-p first looks for the nucleus among this many most likely tokens.
TOP_P_CANDIDATES = 256


def _mask_top_k_(scaled: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Set [S, V] logits below each row's k-th largest value to -inf, in place; top_k: [S] in [1, V)."""
    largest = scaled.topk(max_top_k, dim=-1).values  # [S, max_top_k], descending
    kth = largest.gather(1, (top_k - 1).unsqueeze(1))  # [S, 1]
    return scaled.masked_fill_(scaled < kth, float("-inf"))


def _mask_top_p_(probs: Tensor, top_p: Tensor) -> Tensor:
    """Set [S, V] probabilities outside each row's nucleus to 0, in place; top_p: [S] in (0, 1).

    The nucleus: tokens in decreasing probability while the mass before them is
    < top_p, i.e. the smallest set whose mass reaches top_p; the top token is
    always in it. The row's top TOP_P_CANDIDATES tokens settle it when their mass
    reaches top_p; the other rows are sorted in full.
    """
    num_rows, vocab = probs.shape
    threshold = _nucleus_threshold(probs.topk(min(TOP_P_CANDIDATES, vocab), dim=-1).values, top_p)  # [S]
    wider = threshold.isnan()  # [S] rows whose nucleus is not among the candidates
    if bool(wider.any()):
        rows = wider.nonzero().squeeze(1)
        threshold[rows] = _nucleus_threshold(probs[rows].sort(dim=-1, descending=True).values, top_p[rows])
    return probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)


def _nucleus_threshold(top: Tensor, top_p: Tensor) -> Tensor:
    """Probability of the last token in each row's nucleus, or nan when `top` may not hold it all.

    top: [S, C] each row's C largest probabilities, descending; top_p: [S].
    E.g. top [0.5, 0.3, 0.15, 0.05], top_p 0.7: mass before [0, 0.5, 0.8, 0.95]
    -> 2 tokens kept, threshold 0.3.
    """
    mass_before = top.cumsum(dim=-1) - top  # [S, C]
    kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1)  # [S], >= 1
    threshold = top.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)  # [S]
    # Every candidate kept and their mass still short of top_p: more may follow.
    more = (kept == top.shape[1]) & (mass_before[:, -1] + top[:, -1] < top_p)
    return threshold.masked_fill(more, float("nan"))


def _log_uniform_noise(
    batch: int, vocab: int, generators: Sequence[torch.Generator | None], device: torch.device
) -> Tensor:
    """[B, V] float32 log U with U ~ Uniform[0, 1): minus Exponential(1) noise (cheaper than `exponential_`).

    U < 1 keeps log U < 0; U = 0 gives -inf, and p / -inf = -0, never nan.
    Row i comes from generators[i] when it has one (exactly V uniform draws); the
    other rows share one draw from the device's default generator.
    """
    if all(g is None for g in generators):
        uniform = torch.rand(batch, vocab, device=device)
    else:
        uniform = torch.empty(batch, vocab, device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            uniform[shared] = torch.rand(len(shared), vocab, device=device)
        for i, g in enumerate(generators):
            if g is not None:
                uniform[i] = torch.rand(vocab, generator=g, device=g.device)
    return uniform.log_()


def _check_inputs(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    min_p: Tensor,
    generators: Sequence[torch.Generator | None],
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [B, V] with V > 0, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    batch = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if t.shape != (batch,):
            raise ValueError(f"{name} must be [B] = [{batch}], got shape {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
    if len(generators) != batch:
        raise ValueError(f"generators must have one entry per row ({batch}), got {len(generators)}")
