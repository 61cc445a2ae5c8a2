"""Greedy output compared with monolithic vLLM's, token for token, with one difference allowed: at a
near-tie. fp32 rounding depends on the batch's shape (which requests share a step), so where the
reference's two best tokens are within NEAR_TIE_NATS of each other either may come out; from that
token on the two sequences continue from different text and are not compared."""

from __future__ import annotations

NEAR_TIE_NATS = 0.01


def assert_greedy_tokens_equal(token_ids: list[int], reference_run: dict, index: int) -> None:
    """`token_ids` against prompt `index` of a reference run made with logprobs (its "near_ties")."""
    want = reference_run["token_ids"][index]
    for position, (got, wanted) in enumerate(zip(token_ids, want)):
        if got != wanted:
            margin, runner_up = reference_run["near_ties"][index][position]
            assert margin < NEAR_TIE_NATS and got == runner_up, (
                f"prompt {index} differs at token {position}: got {got}, monolithic vLLM {wanted} "
                f"(ahead by {margin:.4f} nats of {runner_up})", token_ids, want)
            return
    assert len(token_ids) == len(want), (index, token_ids, want)
