from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.decoding.tree import TokenTree, TreeError, TreeStructure

LIMITS = dict(vocab_size=100, max_nodes=16, max_depth=4)


def tree(tokens, parents):
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


@pytest.mark.parametrize(
    ("t", "match"),
    [
        (tree([], []), "empty"),
        (tree([1] * 17, [-1, *range(16)]), "17 nodes, over the limit of 16"),
        (tree([1, 2], [-1]), "parents has 1 entries"),
        (tree([1, 100], [-1, 0]), r"tokens\[1\] = 100 is outside the vocabulary \[0, 100\)"),
        (tree([1, -3], [-1, 0]), r"tokens\[1\] = -3"),
        (tree([1, 2], [0, 0]), r"parents\[0\] must be -1"),
        (tree([1, 2, 3], [-1, 2, 0]), r"parents\[1\] = 2 must be in \[0, 1\)"),
        (tree([1, 2], [-1, 1]), r"parents\[1\] = 1 must be in \[0, 1\)"),
        (tree([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4]), "depth 5 is over the limit of 4"),
    ],
)
def test_bad_trees_are_refused_with_the_field_named(t, match):
    with pytest.raises(TreeError, match=match):
        t.validate(**LIMITS)


def test_valid_tree_structure():
    s = tree([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3]).validate(**LIMITS)
    assert s.depths.tolist() == [0, 1, 1, 2, 3]
    assert np.flatnonzero(s.ancestors[4]).tolist() == [0, 1, 3, 4]
    assert np.flatnonzero(s.ancestors[2]).tolist() == [0, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=0, max_size=60))
def test_ancestors_match_a_naive_walk(choices):
    parents = [-1] + [c % (i + 1) for i, c in enumerate(choices)]
    s = TreeStructure.from_parents(torch.tensor(parents))
    for i in range(len(parents)):
        expected, node = set(), i
        while node >= 0:
            expected.add(node)
            node = parents[node]
        assert set(np.flatnonzero(s.ancestors[i]).tolist()) == expected
        assert int(s.depths[i]) == len(expected) - 1


def test_best_keeps_the_likeliest_nodes_as_a_tree():
    tree = TokenTree(
        torch.tensor([5, 1, 2, 3, 4, 6]),
        torch.tensor([-1, 0, 0, 1, 1, 3]),
        torch.tensor([0.0, -0.1, -1.0, -0.5, -0.3, -0.6]),
    )
    three = tree.best(3)
    assert three.tokens.tolist() == [5, 1, 3, 4] and three.parents.tolist() == [-1, 0, 1, 1]
    four = tree.best(4)  # node 5 (token 6) keeps its parent, node 3 (token 3)
    assert four.tokens.tolist() == [5, 1, 3, 4, 6] and four.parents.tolist() == [-1, 0, 1, 1, 2]
    four.validate(vocab_size=10, max_nodes=8, max_depth=8)
    assert tree.best(0).tokens.tolist() == [5]
    assert tree.best(5) is tree and tree.best(9) is tree


def test_best_keeps_a_tree_whose_logprobs_break_the_order_whole():
    """A child likelier than its parent (a faulty draft): cutting could orphan it."""
    tree = TokenTree(torch.tensor([5, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]), torch.tensor([0.0, -2.0, -0.1, -1.0]))
    assert tree.best(1) is tree
    assert TokenTree(tree.tokens, tree.parents).best(1).size == 4  # no logprobs: nothing to rank by
