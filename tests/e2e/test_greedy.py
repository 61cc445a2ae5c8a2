"""The near-tie rule of tests/e2e/greedy.py: a difference passes only where the reference's two best
tokens were nearly tied and the other one came out."""

from __future__ import annotations

import pytest

from tests.e2e.greedy import assert_greedy_tokens_equal

REFERENCE = {"token_ids": [[5, 6, 7, 8]], "near_ties": [[[2.5, 9], [0.004, 11], [1.0, 3], [0.5, 4]]]}


def test_equal_tokens_pass_and_a_near_tie_taken_the_other_way_ends_the_comparison():
    assert_greedy_tokens_equal([5, 6, 7, 8], REFERENCE, 0)
    assert_greedy_tokens_equal([5, 11, 2, 2], REFERENCE, 0)   # 6 led 11 by 0.004 nats


@pytest.mark.parametrize("token_ids", [[5, 9, 7, 8],     # 5 led 9 by 2.5 nats: not a tie
                                       [5, 12, 7, 8],    # at the tie, but not the runner-up
                                       [5, 6, 7, 3],     # 8 led 3 by 0.5
                                       [5, 6, 7]])       # one token short
def test_any_other_difference_fails(token_ids):
    with pytest.raises(AssertionError):
        assert_greedy_tokens_equal(token_ids, REFERENCE, 0)
