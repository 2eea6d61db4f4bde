"""batching_bound against step counts worked out by hand."""

from __future__ import annotations

import pytest

from service.bench.batching_bound import batching_bound


def test_hand_worked_closed_loop() -> None:
    # outputs [4, 1, 1, 1], 2 slots, 2 outstanding.
    # continuous: [4,1] -> r2 done, r3 sent; [3,1] -> r3 done, r4 sent; [2,1]; [1]: 4 steps.
    # static: batch [4,1] runs 4 steps (r3, r4 arrive meanwhile); batch [1,1]: 1 step: 5.
    b = batching_bound([4, 1, 1, 1], max_num_seqs=2, max_concurrency=2)
    assert (b.continuous_steps, b.static_steps) == (4, 5)
    assert b.ratio == pytest.approx(1.25)


def test_equal_lengths_leave_static_nothing_to_waste() -> None:
    b = batching_bound([128] * 32, max_num_seqs=16, max_concurrency=16)
    assert (b.continuous_steps, b.static_steps) == (256, 256)


def test_all_at_once_more_than_slots() -> None:
    # 3 requests at once, 2 slots. continuous: [5,1] -> [4,2] -> [3,1] -> [2] [1]: 5 steps.
    # static: [5,1] 5 steps, then [2] 2 steps: 7.
    b = batching_bound([5, 1, 2], max_num_seqs=2)
    assert (b.continuous_steps, b.static_steps) == (5, 7)


def test_long_tail_bounds_the_gain() -> None:
    # one 100-token request among 1-token ones: continuous still needs 100 steps
    b = batching_bound([100] + [1] * 15, max_num_seqs=4, max_concurrency=4)
    assert b.continuous_steps == 100
    assert b.static_steps == 100 + 3  # batch [100,1,1,1], then [1,1,1,1] x 3


@pytest.mark.parametrize("kw", [{"max_num_seqs": 0}, {"max_num_seqs": 2, "max_concurrency": 0}])
def test_bad_arguments(kw) -> None:
    with pytest.raises(ValueError):
        batching_bound([1, 2], **kw)
    with pytest.raises(ValueError):
        batching_bound([0], max_num_seqs=1)
