"""The quality gate of 16-bit compute: bf16 serves a row bucket only where the model's
predictions stay with the exact plan's.

bf16 ``F.linear`` rounds both operands to 8 significant bits. On one layer that is a
relative error of about 0.003 (``paths.BF16_ERROR_BOUND``), but what counts is the model's
output after every layer: on the default SmolLM2-135M GGUF, bf16 on the 64- and 512-row
calls of every layer once moved the argmax off the fp32 oracle's on 6% of a text's
positions (docs/perf/HISTORY.md, 2026-12-03), and on small scaled random checkpoints the
logprobs moved by 0.4-0.56 nats (issue 47). So, at start-up, wherever the plan chose bf16
for some bucket, the model scores a text twice, teacher-forced:

- the reference: every bucket that chose bf16 served instead by the path of the nearest
  bucket below that did not (the exact plan: fp32 products, or int16 activations on a
  GGUF file's blocks, teacher-forced top-1 100.0% against the fp32 oracle);
- the candidate: the plan as chosen, the text fed in chunks of that bucket's row count, so
  that the bucket's paths serve every layer's calls;

and the bucket keeps bf16 only where the candidate's argmax agrees with the reference's
on at least ``QualityGate.min_top1`` of the positions and its perplexity is within
``max_perplexity_change`` of the reference's (issue 47's gate). A bucket that fails is
served by the bucket below's path (``DispatchLinear.fns``), and its bf16 weights are
dropped. The third part of issue 47's gate, greedy output identical on 18 of 20 prompts
over 64 tokens, is the accuracy report's (``python -m service.bench.int8_accuracy --mode
auto``): too slow for every start-up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from service.worker.quantization.paths import PATHS
from service.worker.quantization.plan import BUCKETS, DispatchLinear, bucket_index, bucket_rows

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Predictions:
    """What the gate keeps of a model's logits over its text of N tokens: top1 [N - 1]
    int64, the argmax at each position that has a next token; nll [N - 1] float64, the
    negative log-likelihood (nats) of that next token."""

    top1: torch.Tensor
    nll: torch.Tensor


Score = Callable[[int], Predictions]
"""chunk rows -> the Predictions of the gate's text, fed through the model in chunks of
that many tokens."""


def predictions(logits: torch.Tensor, next_ids: Sequence[int]) -> Predictions:
    """Predictions of the first len(next_ids) rows of `logits` ([R, V]) whose next tokens
    are `next_ids` (a chunk's last row predicts the next chunk's first token; the text's
    last has none)."""
    n = len(next_ids)
    rows = logits[:n].float()
    target = torch.tensor(list(next_ids), dtype=torch.int64, device=rows.device)
    nll = torch.nn.functional.cross_entropy(rows, target, reduction="none")
    return Predictions(rows.argmax(-1).cpu(), nll.double().cpu())


@dataclass(frozen=True)
class QualityGate:
    """Issue 47's thresholds against the exact plan (the fp32 oracle's predictions).

    min_top1: fraction of positions whose argmax must agree (0 < x <= 1).
    max_perplexity_change: |ppl - ppl_ref| / ppl_ref at most this (>= 0).
    min_greedy_identical / greedy_prompts: of the accuracy report's prompts, how many must
        give identical greedy output over 64 tokens (checked by the report, not here).
    min_positions: fewer scored positions cannot tell 99.5% from 99% (a KV cache too small
        for the gate's text): then every bucket is refused.
    """

    min_top1: float = 0.995
    max_perplexity_change: float = 0.005
    min_greedy_identical: int = 18
    greedy_prompts: int = 20
    min_positions: int = 400

    def __post_init__(self) -> None:
        if not 0.0 < self.min_top1 <= 1.0:
            raise ValueError(f"min_top1 must be in (0, 1], got {self.min_top1!r}")
        if not self.max_perplexity_change >= 0.0:
            raise ValueError("max_perplexity_change must be >= 0, got "
                             f"{self.max_perplexity_change!r}")
        if not 0 <= self.min_greedy_identical <= self.greedy_prompts:
            raise ValueError("min_greedy_identical must be in [0, greedy_prompts], got "
                             f"{self.min_greedy_identical!r}")


@dataclass(frozen=True)
class GateResult:
    """One bucket's comparison: top-1 agreement over `positions` predictions, and the
    perplexity of the text's next tokens under the reference and the candidate (inf where
    exp(mean NLL) overflows a float, as on random-weight files), with the mean NLLs (nats)
    themselves: the perplexity ratio is exp of their difference, finite where the
    perplexities are not. Results stored before the NLLs were kept have them None."""

    bucket: int
    positions: int
    top1: float
    perplexity_ref: float
    perplexity: float
    nll_ref: float | None = None
    nll: float | None = None

    @property
    def perplexity_change(self) -> float:
        """(ppl - ppl_ref) / ppl_ref, from the mean NLLs where a perplexity overflows; inf
        when neither gives a finite figure."""
        if math.isfinite(self.perplexity) and math.isfinite(self.perplexity_ref):
            return (self.perplexity - self.perplexity_ref) / self.perplexity_ref
        d = self._nll_difference()
        if d is not None:
            return math.expm1(d) if d < 700 else math.inf
        return math.inf

    def _nll_difference(self) -> float | None:
        """nll - nll_ref where both are kept and finite, else None."""
        if self.nll is None or self.nll_ref is None:
            return None
        if not (math.isfinite(self.nll) and math.isfinite(self.nll_ref)):
            return None
        return self.nll - self.nll_ref

    def passes(self, gate: QualityGate = QualityGate()) -> bool:
        return (self.positions >= gate.min_positions and self.top1 >= gate.min_top1
                and abs(self.perplexity_change) <= gate.max_perplexity_change)

    def describe(self) -> str:
        """E.g. "rows 181+: top-1 99.8% of 1023, perplexity 12.41 vs 12.4 (+0.08%)"; where a
        perplexity overflows, the mean NLLs: "..., mean NLL 812.3 vs 812.1 nats (perplexity
        +22.14%)"."""
        head = (f"rows {bucket_rows(self.bucket)}: top-1 {100 * self.top1:.1f}% of "
                f"{self.positions}")
        if (math.isfinite(self.perplexity) and math.isfinite(self.perplexity_ref)) or \
                self._nll_difference() is None:
            return (f"{head}, perplexity {self.perplexity:.5g} vs {self.perplexity_ref:.5g} "
                    f"({100 * self.perplexity_change:+.2f}%)")
        return (f"{head}, mean NLL {self.nll:.5g} vs {self.nll_ref:.5g} nats (perplexity "
                f"{100 * self.perplexity_change:+.2f}%)")


def mean_nll(p: Predictions) -> float:
    """The mean NLL (nats) of the predictions' next tokens; NaN or inf as it comes."""
    return float(p.nll.mean())


def perplexity(p: Predictions) -> float:
    """exp(mean NLL); inf when it is not finite."""
    nll = mean_nll(p)
    return math.exp(nll) if math.isfinite(nll) and nll < 700 else math.inf


def compare(bucket: int, ref: Predictions, got: Predictions) -> GateResult:
    """The gate's figures of `got` against `ref` (the same text's): top-1 agreement over its
    positions, and both perplexities. Raises ValueError when they differ in length or are
    empty."""
    if ref.top1.shape != got.top1.shape or ref.top1.numel() == 0:
        raise ValueError(f"predictions of {ref.top1.numel()} and {got.top1.numel()} positions")
    agree = float((ref.top1 == got.top1).double().mean())
    return GateResult(bucket, ref.top1.numel(), agree, perplexity(ref), perplexity(got),
                      mean_nll(ref), mean_nll(got))


def _is_bf16(name: str) -> bool:
    return PATHS[name].rounds_weights


def bf16_buckets(linears: Sequence[object]) -> list[int]:
    """The bucket indices at which some DispatchLinear among `linears` runs a path that
    rounds the weights (bf16), ascending."""
    found = {b for lin in linears if isinstance(lin, DispatchLinear)
             for b, n in enumerate(lin.names) if _is_bf16(n)}
    return sorted(found)


def _below(lin: DispatchLinear, bucket: int) -> int:
    """The nearest bucket below `bucket` whose path does not round the weights (bucket 0,
    one-row calls, never does: bf16 is offered from 16 rows, ``BF16_MIN_ROWS``)."""
    b = bucket - 1
    while b > 0 and _is_bf16(lin.names[b]):
        b -= 1
    assert not _is_bf16(lin.names[b]), f"{lin.names}: bucket 0 rounds the weights"
    return b


@contextmanager
def exact(linears: Sequence[object]) -> Iterator[None]:
    """Within the block, every bucket of every DispatchLinear that runs bf16 runs the path
    of the nearest bucket below that does not (the reference plan)."""
    saved = []
    for lin in linears:
        if isinstance(lin, DispatchLinear) and any(_is_bf16(n) for n in lin.names):
            saved.append((lin, list(lin.fns)))
            lin.fns = [lin.fns[_below(lin, b)] if _is_bf16(n) else f
                       for b, (f, n) in enumerate(zip(lin.fns, lin.names))]
    try:
        yield
    finally:
        for lin, fns in saved:
            lin.fns = fns


def drop_bucket(linears: Sequence[object], bucket: int) -> None:
    """Serve `bucket` of every DispatchLinear that runs bf16 there by the path of the
    nearest bucket below that does not, for good (its bf16 weights are released when no
    other bucket uses them)."""
    for lin in linears:
        if isinstance(lin, DispatchLinear) and _is_bf16(lin.names[bucket]):
            b = _below(lin, bucket)
            lin.fns = [lin.fns[b] if i == bucket else f for i, f in enumerate(lin.fns)]
            lin.names = tuple(lin.names[b] if i == bucket else n
                              for i, n in enumerate(lin.names))


def apply_verdict(linears: Sequence[object], results: Sequence[GateResult],
                  unreachable: Sequence[int], gate: QualityGate = QualityGate()) -> None:
    """Serve the buckets a stored verdict refused (`results` that fail `gate`, and the
    `unreachable` ones its text could not test) by the exact path below them
    (``drop_bucket``), as ``run_gate`` did when it scored them."""
    for b in unreachable:
        drop_bucket(linears, b)
    for r in results:
        if not r.passes(gate):
            drop_bucket(linears, r.bucket)


def run_gate(linears: Sequence[object], score: Score, tokens: int,
             gate: QualityGate = QualityGate()) -> list[GateResult]:
    """Score the text (`tokens` long) with the reference plan once, then with each bucket
    that chose bf16 (chunks of BUCKETS[b] rows); a bucket that fails `gate`, or whose calls
    the text cannot make (shorter than the bucket's smallest row count), is dropped
    (``drop_bucket``). Returns each tested bucket's result, ascending."""
    buckets = bf16_buckets(linears)
    if not buckets:
        return []
    log.info("quality gate: scoring 16-bit compute for rows %s against the exact plan over %d "
             "tokens (once per model, machine and version: the verdict is kept)",
             ", ".join(bucket_rows(b) for b in buckets), tokens)
    with exact(linears):
        ref = score(max(BUCKETS))
    results = []
    for b in buckets:
        if bucket_index(min(BUCKETS[b], tokens - 1)) != b:
            log.info("16-bit compute refused for rows %s: the quality gate's text (%d "
                     "tokens, capped by the KV cache) cannot make such calls",
                     bucket_rows(b), tokens)
            drop_bucket(linears, b)
            continue
        r = compare(b, ref, score(BUCKETS[b]))
        results.append(r)
        if not r.passes(gate):
            log.info("16-bit compute refused for %s by the quality gate (needs top-1 >= "
                     "%.1f%% and perplexity within %.1f%%): that bucket keeps its exact "
                     "path", r.describe(), 100 * gate.min_top1,
                     100 * gate.max_perplexity_change)
            drop_bucket(linears, b)
    return results
