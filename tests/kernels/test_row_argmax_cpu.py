"""The C++ row argmax (kernels.row_argmax_cpu) against torch: first index among ties, rows
that cannot be sampled greedily (NaN, +inf, all -inf) marked -1, odd lengths, strided rows,
thread counts; and the sampler's greedy_tokens, kernel and torch paths alike."""

from __future__ import annotations

import pytest
import torch

from kernels import row_argmax_cpu as rac
from service.worker.sampler import greedy_tokens

needs_kernel = pytest.mark.skipif(rac.build_problem() is not None,
                                  reason=f"C++ kernel does not build here: {rac.build_problem()}")


def _torch(logits: torch.Tensor) -> torch.Tensor:
    top, idx = logits.max(dim=-1)
    return idx.masked_fill_(~torch.isfinite(top), -1)


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 100, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 5])
def test_matches_torch(n, rows) -> None:
    g = torch.Generator().manual_seed(n * 10 + rows)
    logits = torch.randn(rows, n, generator=g)
    assert torch.equal(rac.row_argmax(logits), torch.argmax(logits, dim=-1))


@needs_kernel
@pytest.mark.parametrize("n", [5, 40, 49152])
def test_ties_take_the_first_index(n) -> None:
    logits = torch.zeros(3, n)
    logits[0, [n - 1, 2 % n]] = 4.0           # two maxima: the lower index
    logits[1, :] = 1.5                         # every value the same: 0
    logits[2, [n // 2, n - 1]] = 9.0     # finite ties past the middle
    assert rac.row_argmax(logits).tolist() == [min(n - 1, 2 % n), 0, n // 2]


@needs_kernel
def test_rows_that_cannot_be_sampled_greedily_are_minus_one() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    logits[0, 7] = float("nan")          # a NaN anywhere (not at the max)
    logits[1, 999] = float("inf")        # +inf
    logits[2] = float("-inf")            # every value -inf
    logits[3, :500] = float("-inf")      # -inf beside finite values: fine
    logits[4, 0] = float("nan")          # a NaN in the first vector
    want = _torch(logits)
    got = rac.row_argmax(logits)
    assert got.tolist()[:3] == [-1, -1, -1] and got[4].item() == -1
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_rows_and_thread_counts(threads) -> None:
    wide = torch.randn(16, 300, generator=torch.Generator().manual_seed(4))
    logits = wide[:, 10:250]  # rows 300 floats apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rac.row_argmax(logits)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert rac.row_argmax(torch.empty(0, 10)).shape == (0,)


@needs_kernel
def test_checks() -> None:
    with pytest.raises(ValueError, match="float32"):
        rac.row_argmax(torch.randn(2, 10).double())
    with pytest.raises(ValueError, match="unit stride"):
        rac.row_argmax(torch.randn(10, 2).t())
    with pytest.raises(ValueError, match="V"):
        rac.row_argmax(torch.randn(3))


def test_greedy_tokens_kernel_and_torch_paths_agree() -> None:
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5))
    logits[1, 5] = float("nan")
    logits[2, 2999] = logits[2].max() + 1
    want = _torch(logits)
    assert torch.equal(greedy_tokens(logits), want)           # fp32: the kernel where it builds
    assert torch.equal(greedy_tokens(logits.double()), want)  # other dtypes: torch


@needs_kernel
def test_an_expanded_row() -> None:
    row = torch.randn(1, 500, generator=torch.Generator().manual_seed(6))
    logits = row.expand(7, 500)  # stride 0 between rows
    assert torch.equal(rac.row_argmax(logits), torch.argmax(logits, dim=-1))
