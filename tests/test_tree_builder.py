"""The tree builder must return exactly the `budget` most probable reachable nodes (brute force)."""

from __future__ import annotations

import hashlib

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

    def expand(self, nodes, tokens, depths, visible):
        for node, token in zip(nodes.tolist(), tokens.tolist(), strict=True):
            self.slots[node - 1] = token
        out = []
        for row in visible:
            path = tuple(self.slots[j] for j in row.nonzero().squeeze(1).tolist())
            out.append(toy_logprobs((0, *path)))
        self.forwards.append(len(nodes))
        return torch.stack(out)

    def move(self, src, dst):
        self.moves += 1
        values = [self.slots[s] for s in src.tolist()]
        for d, v in zip(dst.tolist(), values, strict=True):
            self.slots[d] = v


def brute_force(params: TreeParams) -> dict[tuple[int, ...], float]:
    nodes: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    for _ in range(params.max_depth):
        nxt = []
        for path, score in frontier:
            lp = toy_logprobs((0, *path))
            top = lp.topk(min(params.max_branch, VOCAB))
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                nxt.append(((*path, t), score + v))
        nodes.update(nxt)
        frontier = nxt
    best = sorted(nodes.items(), key=lambda kv: -kv[1])[: params.budget]
    return dict(best)


def built_paths(params: TreeParams) -> tuple[dict[tuple[int, ...], float], ToyExpander, object]:
    expander = ToyExpander()
    built = TreeBuilder(params).build(0, toy_logprobs((0,)), expander)
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
    [("budget", 0), ("max_depth", 0), ("max_branch", 0), ("expand_batch", 0), ("budget", 10**6)],
)
def test_bad_tree_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TreeParams(**{field: value})
