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

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from common.decoding.tree import MAX_BUDGET, TokenTree, TreeParams

# An idle step expands a node only if it could be expanded in the next tree: the next root is one of
# its ancestors, reached with about that ancestor's probability, and the tree below it expands nodes
# at least `min_prob` as likely as it. A node below `min_prob` times this share has at most this
# chance of such a root. Without a bound the search grew to its cap on every tree, a core's full
# load while trees did not pay (prose), which slowed the target beside it on one box by 10-20%.
IDLE_FLOOR_SHARE = 1 / 16

__all__ = ["MAX_BUDGET", "BuiltTree", "Expander", "ExpansionRefused", "TreeBuilder", "TreeParams"]


class ExpansionRefused(Exception):
    """An expander had no room for a batch (a shared cache's sequence ids) and changed nothing: the
    search stops growing there, and its tree is the best it has."""


class Expander(Protocol):
    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor, parents: Tensor) -> Tensor:
        """Draft log-probs [len(nodes), V] for `nodes` (working ids, KV slot = id - 1), or
        `ExpansionRefused`.

        `visible[r, j]` says whether row r may attend to tree slot j (the prefix is always visible);
        `parents[r]` is row r's parent's working id (0: the root, whose KV is the prefix's last).
        """
        ...

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Move tree KV slots `src` to `dst` (src >= dst elementwise, both increasing); the KV of
        every other slot is no longer needed."""
        ...

    def drop(self, slots: Tensor) -> None:
        """The nodes at these tree KV slots were pruned: their KV is no longer needed."""
        ...


@dataclass(frozen=True)
class BuiltTree:
    tree: TokenTree
    slots: Tensor  # int64 [n]; tree KV slot of each node (-1 for the root)
    expanded: Tensor  # bool [n]; whether the node's KV was computed (it was expanded)
    draft_forwards: int


class TreeBuilder:
    """Working arrays are allocated once per builder and reused for every tree."""

    def __init__(self, params: TreeParams, search: bool = False) -> None:
        """A `search` (the draft node's lookahead) keeps every child it has room for and lets idle-time
        steps expand below the expansion floor (to IDLE_FLOOR_SHARE of it) and past the request's
        depth: the floor prices the step's wait, idle time costs only power and, on one box, the
        target's memory bandwidth, and the next tree's root lies below this one's deepest node
        when all of it is accepted. What it ships (`take`) and what a request waits for (`grow`)
        still obey the request's floors and depth."""
        self.params = params
        self.search = search
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
        # Under a grammar: (each expanded node's tokens below the root, their log-probs [r, V], k) ->
        # the k best children the grammar allows there, log-probs renormalized over what it allows,
        # -inf where fewer, and their tokens: float [r, k], int64 [r, k] (draft_node.session)
        self.constrain: Callable[[list[list[int]], Tensor, int], tuple[Tensor, Tensor]] | None = None

    def build(
        self, root_token: int, root_logprobs: Tensor, expander: Expander, params: TreeParams | None = None
    ) -> BuiltTree:
        """`params`, if given, must have this builder's shape; its floors apply to this tree only."""
        self.start(root_token, root_logprobs, params)
        return self.take(self.params.budget, self.grow(expander, self.params.budget))

    def start(self, root_token: int, root_logprobs: Tensor, params: TreeParams | None = None) -> None:
        self.set_floors(params or self.params)
        self._reset(root_token)
        self._add_children(torch.zeros(1, dtype=torch.long), root_logprobs[None])

    def set_floors(self, params: TreeParams) -> None:
        """A request's floors and depth, for this search from now on; any budget and depth up to the
        builder's fit."""
        same = replace(params.shape, budget=self.params.budget, max_depth=self.params.max_depth) == self.params.shape
        if not same or params.budget > self.params.budget or params.max_depth > self.params.max_depth:
            raise ValueError(f"params {params} do not fit a builder made for {self.params.shape}")
        self.floor = math.log(params.min_prob) if params.min_prob > 0 else -math.inf
        self.idle_floor = self.floor + math.log(IDLE_FLOOR_SHARE)
        self.node_floor = math.log(params.min_node_prob) if params.min_node_prob > 0 else -math.inf
        self.depth = params.max_depth

    def grow(self, expander: Expander, budget: int) -> int:
        """Expand until the `budget` best nodes are final; returns the draft forwards it took. A search
        that keeps more nodes than `budget` (the draft node's lookahead) goes on later with `step`."""
        forwards = 0
        with contextlib.suppress(ExpansionRefused):
            while self.step(expander, budget):
                forwards += 1
        return forwards

    def step(self, expander: Expander, budget: int | None = None, idle: bool = False) -> bool:
        """One batched expansion of the best open nodes; False once none could still place a child
        among the `budget` best (default: every node this search keeps). An `idle` step of a search
        lowers the expansion floor to what the next tree might expand (IDLE_FLOOR_SHARE)."""
        p = self.params
        budget = p.budget if budget is None else budget
        floor, depth = (self.idle_floor, p.max_depth) if idle and self.search else (self.floor, self.depth)
        nodes = self._next_batch(budget, floor, depth)
        if nodes.numel() == 0:
            return False
        if self.used + min(nodes.numel() * p.max_branch, p.budget) > self.capacity:
            self._compact(expander)
            nodes = self._next_batch(budget, floor, depth)
        logprobs = expander.expand(
            nodes, self.tokens[nodes], self.depths[nodes], self.ancestors[nodes, 1 : self.used], self.parents[nodes]
        )
        self.expanded[nodes] = True
        pruned = self._add_children(nodes, logprobs)
        pruned = pruned[self.expanded[pruned]]
        if pruned.numel():
            expander.drop(pruned - 1)
        return True

    def take(self, budget: int, forwards: int) -> BuiltTree:
        """The `budget` best nodes at or above the node floor and within the request's depth, with the
        root: closed under ancestors, since a child never scores above its parent, lies deeper, and
        loses ties to the older node."""
        best = self._best(budget, self.depth)
        best = best[self.scores[best] >= self.node_floor]
        keep = torch.cat((torch.zeros(1, dtype=torch.long), best.sort().values))
        n = self.used
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        tree = TokenTree(self.tokens[keep].numpy(), parents.numpy(), self.scores[keep].numpy())
        return BuiltTree(tree, keep - 1, self.expanded[keep].clone(), forwards)

    def reroot(self, tokens: list[int], expander: Expander) -> int:
        """Follow `tokens` down from the root. If they end on an expanded node, make it the root: its
        path's KV becomes committed prefix, its subtree (KV included) the search, and the number of
        tokens whose KV was moved is returned. Otherwise the KV of the path's leading expanded nodes
        is moved into the prefix, the search is dropped (`used` = 0), and their count returned."""
        path = self._walk(tokens)
        if len(path) == len(tokens) and path and bool(self.expanded[path[-1]]):
            self._reroot_at(path, expander)
            return len(path)
        ids = torch.tensor(path, dtype=torch.long)
        unexpanded = (~self.expanded[ids]).nonzero()
        if unexpanded.numel():
            ids = ids[: int(unexpanded[0])]
        if ids.numel():
            expander.move(ids - 1, torch.arange(ids.numel()))
        self.used = 0
        return ids.numel()

    def _walk(self, tokens: list[int]) -> list[int]:
        """Ids of the alive nodes spelling `tokens` below the root, as far as they exist."""
        n, node, path = self.used, 0, []
        if n == 0:
            return path
        for token in tokens:
            children = ((self.parents[:n] == node) & self.alive[:n] & (self.tokens[:n] == token)).nonzero()
            if children.numel() == 0:
                break
            node = int(children[0])
            path.append(node)
        return path

    def _reroot_at(self, path: list[int], expander: Expander) -> None:
        n, root = self.used, path[-1]
        d = len(path)
        below = self.ancestors[:n, root] & self.alive[:n]
        below[root] = False
        sub = below.nonzero().squeeze(1)  # increasing ids: parents before children
        # KV: the path to the prefix's end, the subtree after it (src >= dst, both increasing).
        moved = sub[self.expanded[sub]]
        ids = torch.tensor(path, dtype=torch.long)
        new_ids = torch.arange(1, sub.numel() + 1)
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[root] = 0
        remap[sub] = new_ids
        expander.move(torch.cat((ids - 1, moved - 1)), torch.cat((torch.arange(d), d + remap[moved] - 1)))
        self._keep_rows(torch.cat((torch.tensor([root]), sub)), remap)

    def _best(self, budget: int, depth: int | None = None) -> Tensor:
        """Ids of the `budget` best alive nodes besides the root, at most `depth` deep, best first
        (ties: older first)."""
        n = self.used
        alive = self.alive[1:n] if depth is None else self.alive[1:n] & (self.depths[1:n] <= depth)
        ids = alive.nonzero().squeeze(1) + 1
        if ids.numel() <= budget:
            return ids
        return ids[torch.sort(-self.scores[ids], stable=True).indices[:budget]]

    def _reset(self, root_token: int) -> None:
        self.alive.zero_()
        self.expanded.zero_()
        self.ancestors[: self.used, : self.used] = False
        self.tokens[0], self.parents[0], self.depths[0], self.scores[0] = root_token, -1, 0, 0.0
        self.alive[0] = self.expanded[0] = True
        self.ancestors[0, 0] = True
        self.used = 1

    def _next_batch(self, budget: int, floor: float, depth: int) -> Tensor:
        """The best unexpanded nodes at or above `floor`, above `depth`, that could still have a
        child among the `budget` best."""
        p, n = self.params, self.used
        open_ = self.alive[:n] & ~self.expanded[:n] & (self.depths[:n] < depth)
        open_ &= self.scores[:n] >= floor
        kept = self.scores[1:n][self.alive[1:n] & (self.depths[1:n] <= depth)]
        if kept.numel() >= budget:
            # A child scores at most its parent and loses ties to older nodes, so a node no
            # better than the `budget`-th best one can never place a child among them.
            open_ &= self.scores[:n] > (kept.min() if kept.numel() == budget else kept.topk(budget).values[-1])
        candidates = open_.nonzero().squeeze(1)
        if candidates.numel() > p.expand_batch:
            order = torch.sort(-self.scores[candidates], stable=True).indices[: p.expand_batch]
            candidates = candidates[order.sort().values]
        return candidates

    def _add_children(self, nodes: Tensor, logprobs: Tensor) -> Tensor:
        """Returns the ids of the older nodes pruned to make room."""
        p, n = self.params, self.used
        k = min(p.max_branch, logprobs.shape[-1])
        if self.constrain is not None:
            child_lp, child_tok = self.constrain(self._paths(nodes), logprobs, k)
        else:
            child_lp, child_tok = logprobs.float().topk(k, dim=-1)
        child_scores = (self.scores[nodes, None] + child_lp).flatten()
        child_parent = nodes[:, None].expand(-1, k).flatten()
        child_tok = child_tok.flatten()
        finite = torch.isfinite(child_scores)
        if not self.search:
            finite &= child_scores >= self.node_floor
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
        pruned = old[~is_kept[: old.numel()]]
        self.alive[pruned] = False
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
        return pruned

    def _paths(self, nodes: Tensor) -> list[list[int]]:
        """Each node's tokens below the root, root first: along a path ids only grow."""
        n = self.used
        return [self.tokens[:n][self.ancestors[int(node), :n]].tolist()[1:] for node in nodes]

    def _compact(self, expander: Expander) -> None:
        """Drop pruned nodes so ids stay within capacity; expanded survivors carry their KV along."""
        n = self.used
        keep = self.alive[:n].nonzero().squeeze(1)
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        moved = keep[self.expanded[keep] & (keep > 0)]
        if moved.numel():
            expander.move(moved - 1, remap[moved] - 1)
        self._keep_rows(keep, remap)

    def _keep_rows(self, keep: Tensor, remap: Tensor) -> None:
        """Rows `keep` (increasing after the first, which becomes the root) move to the front, parents
        renumbered by `remap` (old id -> new, -1 if dropped); depths and scores become relative to the
        new root. Shared by compaction (root unchanged) and re-rooting."""
        n, m = self.used, keep.numel()
        depth0, score0 = int(self.depths[keep[0]]), float(self.scores[keep[0]])
        self.tokens[:m] = self.tokens[keep]
        parents = self.parents[keep]
        self.parents[:m] = torch.where(parents >= 0, remap[parents.clamp(min=0)], -1)
        self.parents[0] = -1
        self.depths[:m] = self.depths[keep] - depth0
        self.scores[:m] = self.scores[keep] - score0
        self.expanded[:m] = self.expanded[keep]
        self.alive[:m] = True
        self.alive[m:n] = False
        self.expanded[m:n] = False
        anc = self.ancestors[keep][:, keep]
        self.ancestors[:n, :n] = False
        self.ancestors[:m, :m] = anc
        self.used = m
