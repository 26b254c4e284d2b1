"""SpecExec's tree search: a batched best-first search by cumulative draft log-probability.

The result is exactly the `budget` most probable nodes reachable when every node may have its
`max_branch` most likely children and depth is capped at `max_depth` (ties go to the older node).
With a `min_prob` floor, only nodes at least that probable (cumulatively) may have children: the
draft stops where its confidence runs out, so one step's tree is a long chain through text it is
sure of and a short bush where it is not, and no forward is spent on a node whose children are dropped.
With a `min_node_prob` floor, nodes less probable than it are never proposed: on a target whose pass
grows with the tree, a node that unlikely costs more of the pass than it can bring back.
Why that holds: a child never scores above its parent, so the kept set stays closed under ancestors;
a pruned node only ever loses to nodes that stay; and the search ends only when every kept node
that could still have a kept child has been expanded.

The builder knows nothing of models: an `Expander` runs the draft over a batch of nodes and moves
KV slots when the node arrays are compacted. Node `i` (i >= 1) of the working arrays owns KV slot
`i - 1` after the committed prefix; node 0 is the root, whose KV is part of the prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from common.decoding.tree import MAX_BUDGET, TokenTree, TreeParams

__all__ = ["MAX_BUDGET", "BuiltTree", "Expander", "TreeBuilder", "TreeParams"]


class Expander(Protocol):
    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor) -> Tensor:
        """Draft log-probs [len(nodes), V] for `nodes` (working ids, KV slot = id - 1).

        `visible[r, j]` says whether row r may attend to tree slot j (the prefix is always visible).
        """
        ...

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Move tree KV slots `src` to `dst` (src >= dst elementwise, both increasing)."""
        ...


@dataclass(frozen=True)
class BuiltTree:
    tree: TokenTree
    slots: Tensor  # int64 [n]; tree KV slot of each node (-1 for the root)
    expanded: Tensor  # bool [n]; whether the node's KV was computed (it was expanded)
    draft_forwards: int


class TreeBuilder:
    """Working arrays are allocated once per builder and reused for every tree."""

    def __init__(self, params: TreeParams) -> None:
        self.params = params
        p = params
        self.capacity = 1 + p.budget + min(p.expand_batch * p.max_branch, p.budget)
        c = self.capacity
        self.tokens = torch.zeros(c, dtype=torch.long)
        self.parents = torch.zeros(c, dtype=torch.long)
        self.depths = torch.zeros(c, dtype=torch.long)
        self.scores = torch.zeros(c)
        self.alive = torch.zeros(c, dtype=torch.bool)
        self.expanded = torch.zeros(c, dtype=torch.bool)
        self.ancestors = torch.zeros(c, c, dtype=torch.bool)
        self.used = 0

    def _set_floors(self, params: TreeParams) -> None:
        self.floor = math.log(params.min_prob) if params.min_prob > 0 else -math.inf
        self.node_floor = math.log(params.min_node_prob) if params.min_node_prob > 0 else -math.inf

    def build(
        self, root_token: int, root_logprobs: Tensor, expander: Expander, params: TreeParams | None = None
    ) -> BuiltTree:
        """`params`, if given, must have this builder's shape; its floors apply to this tree only."""
        if params is not None and params.shape != self.params.shape:
            raise ValueError(f"params {params} do not fit a builder made for {self.params.shape}")
        self._set_floors(params or self.params)
        p = self.params
        self._reset(root_token)
        self._add_children(torch.zeros(1, dtype=torch.long), root_logprobs[None])
        forwards = 0
        while True:
            nodes = self._next_batch()
            if nodes.numel() == 0:
                break
            if self.used + min(nodes.numel() * p.max_branch, p.budget) > self.capacity:
                self._compact(expander)
                nodes = self._next_batch()
            logprobs = expander.expand(
                nodes, self.tokens[nodes], self.depths[nodes], self.ancestors[nodes, 1 : self.used]
            )
            forwards += 1
            self.expanded[nodes] = True
            self._add_children(nodes, logprobs)
        return self._result(forwards)

    def _reset(self, root_token: int) -> None:
        self.alive.zero_()
        self.expanded.zero_()
        self.ancestors[: self.used, : self.used] = False
        self.tokens[0], self.parents[0], self.depths[0], self.scores[0] = root_token, -1, 0, 0.0
        self.alive[0] = self.expanded[0] = True
        self.ancestors[0, 0] = True
        self.used = 1

    def _next_batch(self) -> Tensor:
        """The best unexpanded nodes that could still have a child in the final tree."""
        p, n = self.params, self.used
        open_ = self.alive[:n] & ~self.expanded[:n] & (self.depths[:n] < p.max_depth)
        open_ &= self.scores[:n] >= self.floor
        kept = int(self.alive[:n].sum()) - 1
        if kept >= p.budget:
            # A child scores at most its parent and loses ties to older nodes, so a node no
            # better than the worst kept one can never place a child in the tree.
            worst = self.scores[1:n][self.alive[1:n]].min()
            open_ &= self.scores[:n] > worst
        candidates = open_.nonzero().squeeze(1)
        if candidates.numel() > p.expand_batch:
            order = torch.sort(-self.scores[candidates], stable=True).indices[: p.expand_batch]
            candidates = candidates[order.sort().values]
        return candidates

    def _add_children(self, nodes: Tensor, logprobs: Tensor) -> None:
        p, n = self.params, self.used
        k = min(p.max_branch, logprobs.shape[-1])
        child_lp, child_tok = logprobs.float().topk(k, dim=-1)
        child_scores = (self.scores[nodes, None] + child_lp).flatten()
        child_parent = nodes[:, None].expand(-1, k).flatten()
        child_tok = child_tok.flatten()
        finite = torch.isfinite(child_scores) & (child_scores >= self.node_floor)
        child_scores, child_parent, child_tok = child_scores[finite], child_parent[finite], child_tok[finite]

        old = self.alive[1:n].nonzero().squeeze(1) + 1
        scores = torch.cat((self.scores[old], child_scores))
        if scores.numel() > p.budget:
            # Stable sort on id order: equal scores keep the older node, so parents beat children.
            keep = torch.sort(-scores, stable=True).indices[: p.budget]
            is_kept = torch.zeros(scores.numel(), dtype=torch.bool)
            is_kept[keep] = True
        else:
            is_kept = torch.ones(scores.numel(), dtype=torch.bool)
        self.alive[old[~is_kept[: old.numel()]]] = False
        new = is_kept[old.numel() :]
        count = int(new.sum())
        ids = torch.arange(n, n + count)
        parents = child_parent[new]
        self.tokens[ids] = child_tok[new]
        self.parents[ids] = parents
        self.depths[ids] = self.depths[parents] + 1
        self.scores[ids] = child_scores[new]
        self.alive[ids] = True
        self.expanded[ids] = False
        self.ancestors[ids] = self.ancestors[parents]
        self.ancestors[ids, ids] = True
        self.used = n + count

    def _compact(self, expander: Expander) -> None:
        """Drop pruned nodes so ids stay within capacity; expanded survivors carry their KV along."""
        n = self.used
        keep = self.alive[:n].nonzero().squeeze(1)
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        moved = keep[self.expanded[keep] & (keep > 0)]
        if moved.numel():
            expander.move(moved - 1, remap[moved] - 1)
        m = keep.numel()
        self.tokens[:m] = self.tokens[keep]
        parents = self.parents[keep]
        self.parents[:m] = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        self.depths[:m] = self.depths[keep]
        self.scores[:m] = self.scores[keep]
        self.expanded[:m] = self.expanded[keep]
        self.alive[:m] = True
        self.alive[m:n] = False
        self.expanded[m:n] = False
        anc = self.ancestors[keep][:, keep]
        self.ancestors[:n, :n] = False
        self.ancestors[:m, :m] = anc
        self.used = m

    def _result(self, forwards: int) -> BuiltTree:
        n = self.used
        keep = self.alive[:n].nonzero().squeeze(1)
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        tree = TokenTree(self.tokens[keep].clone(), parents, self.scores[keep].clone())
        return BuiltTree(tree, keep - 1, self.expanded[keep].clone(), forwards)
