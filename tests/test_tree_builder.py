"""The tree builder must return exactly the `budget` most probable reachable nodes (brute force)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest
import torch

from draft_node.tree_builder import TreeBuilder, TreeParams

VOCAB = 12


def toy_logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed 'draft model': next-token log-probs as a pure function of the path."""
    seed = int.from_bytes(hashlib.sha256(repr(path).encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 2.0, -1)


class ToyExpander:
    """Stores each expanded node's token at its slot, as a model stores K/V, and reads paths back."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.moves = 0
        self.forwards: list[int] = []

    def expand(self, nodes, tokens, depths, visible, parents):
        for node, token, parent in zip(nodes.tolist(), tokens.tolist(), parents.tolist(), strict=True):
            assert parent == 0 or parent - 1 in self.slots, "a node's parent must have been expanded"
            self.slots[node - 1] = token
        out = []
        for row in visible:
            path = tuple(self.slots[j] for j in row.nonzero().squeeze(1).tolist())
            out.append(toy_logprobs((0, *path)))
        self.forwards.append(len(nodes))
        return torch.stack(out)

    def drop(self, slots):
        for slot in slots.tolist():
            del self.slots[slot]  # a pruned node's KV is never read again

    def move(self, src, dst):
        self.moves += 1
        values = [self.slots[s] for s in src.tolist()]
        for d, v in zip(dst.tolist(), values, strict=True):
            self.slots[d] = v


def brute_force(params: TreeParams) -> dict[tuple[int, ...], float]:
    """The top `budget` nodes at least `min_node_prob` probable among the children of nodes whose
    cumulative probability is at least `min_prob` (the root always is)."""
    nodes: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    floor = math.log(params.min_prob) if params.min_prob else -math.inf
    node_floor = math.log(params.min_node_prob) if params.min_node_prob else -math.inf
    for _ in range(params.max_depth):
        nxt = []
        for path, score in frontier:
            if score < floor:
                continue
            lp = toy_logprobs((0, *path))
            top = lp.topk(min(params.max_branch, VOCAB))
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if score + v >= node_floor:
                    nxt.append(((*path, t), score + v))
        nodes.update(nxt)
        frontier = nxt
    best = sorted(nodes.items(), key=lambda kv: -kv[1])[: params.budget]
    return dict(best)


def built_paths(
    params: TreeParams, builder: TreeBuilder | None = None
) -> tuple[dict[tuple[int, ...], float], ToyExpander, object]:
    expander = ToyExpander()
    built = (builder or TreeBuilder(params)).build(0, toy_logprobs((0,)), expander, params)
    tree = built.tree
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, tree.size):
        paths[i] = (*paths[int(tree.parents[i])], int(tree.tokens[i]))
    return {paths[i]: float(tree.logprobs[i]) for i in range(1, tree.size)}, expander, built


@pytest.mark.parametrize("budget", [1, 5, 20, 60, 120, 200])
@pytest.mark.parametrize(("branch", "depth"), [(3, 4), (2, 6), (12, 2)])
@pytest.mark.parametrize("expand_batch", [1, 4, 64])
def test_tree_is_exactly_the_best_reachable_nodes(budget, branch, depth, expand_batch):
    params = TreeParams(budget=budget, max_depth=depth, max_branch=branch, expand_batch=expand_batch)
    ours, expander, built = built_paths(params)
    expected = brute_force(params)
    assert set(ours) == set(expected)
    for path, score in ours.items():
        assert score == pytest.approx(expected[path], abs=1e-5)
    assert len(ours) <= budget
    assert max(len(p) for p in ours) <= depth
    assert max(expander.forwards, default=0) <= expand_batch
    # Expanded flags and KV slots stay consistent through compaction.
    for i in torch.nonzero(built.expanded).squeeze(1).tolist():
        if i:
            assert expander.slots[int(built.slots[i])] == int(built.tree.tokens[i])


@pytest.mark.parametrize("min_prob", [0.05, 0.2, 0.5, 0.9])
@pytest.mark.parametrize(("budget", "branch"), [(1, 1), (6, 1), (8, 3), (60, 4)])
def test_a_confidence_floor_expands_only_nodes_that_probable(min_prob, budget, branch):
    params = TreeParams(budget=budget, max_depth=8, max_branch=branch, expand_batch=4, min_prob=min_prob)
    ours, expander, built = built_paths(params)
    expected = brute_force(params)
    assert set(ours) == set(expected)
    floor = math.log(min_prob)
    scores = built.tree.logprobs
    assert bool((scores[built.expanded] >= floor).all())  # no forward is spent on a node under it
    # Each node's parent cleared the floor, so only leaves are under it; the search stops by itself.
    parents = built.tree.parents[1:]
    assert bool((scores[parents] >= floor).all())
    unbounded = built_paths(replace(params, min_prob=0.0))[1]
    assert len(expander.forwards) <= len(unbounded.forwards)


@pytest.mark.parametrize("min_node_prob", [0.001, 0.02, 0.1, 0.4])
@pytest.mark.parametrize(
    ("budget", "branch", "min_prob"), [(6, 1, 0.0), (8, 3, 0.0), (60, 4, 0.0), (60, 4, 0.3)]
)
def test_a_node_floor_proposes_only_nodes_that_probable(min_node_prob, budget, branch, min_prob):
    params = TreeParams(budget, 8, branch, 4, min_prob=min_prob, min_node_prob=min_node_prob)
    ours, _, built = built_paths(params)
    assert set(ours) == set(brute_force(params))
    assert bool((built.tree.logprobs >= math.log(min_node_prob)).all())
    assert set(ours) <= set(built_paths(replace(params, min_node_prob=0.0))[0])


def test_one_builder_serves_any_floors_and_refuses_another_shape():
    """A draft session keeps one builder per shape: `--budget auto` moves the floors every step."""
    shape = TreeParams(budget=40, max_depth=6, max_branch=4, expand_batch=4)
    builder = TreeBuilder(shape)
    for floors in [(0.0, 0.0), (0.5, 0.01), (0.1, 0.2), (0.0, 0.0)]:
        params = replace(shape, min_prob=floors[0], min_node_prob=floors[1])
        assert set(built_paths(params, builder)[0]) == set(brute_force(params))
    with pytest.raises(ValueError, match="do not fit"):
        builder.build(0, toy_logprobs((0,)), ToyExpander(), replace(shape, budget=41))


def test_a_confident_chain_runs_to_its_length_and_an_unsure_one_stops():
    sure, _, built = built_paths(TreeParams.chain(5, min_prob=1e-9))
    assert len(sure) == 5 and built.draft_forwards == 4
    unsure, _, built = built_paths(TreeParams.chain(5, min_prob=0.999))
    assert len(unsure) == 1 and built.draft_forwards == 0  # the root's best child, from the root's pass


def test_compaction_is_exercised():
    moves = 0
    for budget in (5, 20, 60):
        _, expander, _ = built_paths(TreeParams(budget=budget, max_depth=6, max_branch=2, expand_batch=1))
        moves += expander.moves
    assert moves > 0


def test_chain_params_give_the_greedy_chain():
    ours, _, built = built_paths(TreeParams.chain(5))
    path, chain = (), []
    for _ in range(5):
        t = int(toy_logprobs((0, *path)).argmax())
        path = (*path, t)
        chain.append(path)
    assert set(ours) == set(chain)
    assert built.tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("budget", 0),
        ("max_depth", 0),
        ("max_branch", 0),
        ("expand_batch", 0),
        ("budget", 10**6),
        ("min_prob", 1.0),
        ("min_node_prob", 1.0),
        ("min_node_prob", -0.01),
        ("min_node_prob", float("nan")),
        ("min_prob", -0.1),
        ("min_prob", float("nan")),
    ],
)
def test_bad_tree_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TreeParams(**{field: value})
