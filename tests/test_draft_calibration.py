"""benchmarks/draft_calibration.py checks the planner's premise; its trials must be the fair ones."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import draft_calibration as script
from common.decoding.tree import TokenTree


def tree() -> TokenTree:
    """root -> a (0.7), b (0.2), c (0.1); a -> d (0.9 given a); b -> e (0.5 given b)."""
    q = [1.0, 0.7, 0.2, 0.1, 0.63, 0.1]
    return TokenTree(
        torch.tensor([5, 10, 11, 12, 13, 14]),
        torch.tensor([-1, 0, 0, 0, 1, 2]),
        torch.tensor([math.log(x) for x in q]),
    )


def test_trials_are_the_children_of_accepted_nodes_with_their_conditional_p_and_rank():
    t = tree()
    path = t.walk([10, 13, 99])
    assert path == [0, 1, 4]
    rows = script.trials(t, path)
    # b's child e is no trial: b was rejected. d was accepted and has no children.
    assert [(round(p, 3), rank, taken) for p, rank, taken in rows] == [
        (0.7, 0, True),
        (0.2, 1, False),
        (0.1, 2, False),
        (0.9, 0, True),
    ]


def test_table_bins_by_p_and_counts_ranks():
    lines = script.table([(0.7, 0, True), (0.2, 1, False), (0.1, 2, False), (0.9, 0, True), (1.0, 0, True)])
    body = "\n".join(lines)
    assert "| 0.70–0.80 | 1 | 0.700 | 1.000 |" in body
    assert "| 0.20–0.30 | 1 | 0.200 | 0.000 |" in body
    assert "| 0.95–1.00 | 1 | 1.000 | 1.000 |" in body  # p = 1 lands in the last bin
    assert "1: 1.00 of 3" in body and "2: 0.00 of 1" in body


@pytest.mark.parametrize("p", [0.0, 0.019, 0.5, 0.999])
def test_every_p_lands_in_one_bin(p):
    assert sum("| 1 |" in line for line in script.table([(p, 0, False)])) == 1
