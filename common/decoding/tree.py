"""The token tree that travels from draft to target, and the attention structure derived from it.

Node 0 is the root: the last committed token, whose continuation the tree proposes. Every other node's
parent precedes it, so index order is a topological order and a node's index can be its KV slot.
Masks are never shipped: they are derived here from `parents`, so a peer cannot send an inconsistent one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

MAX_TREE_DEPTH = 128
DEFAULT_CHAIN_LENGTH = 4  # chain mode's length where no budget is given for it
MAX_BUDGET = 8192


@dataclass(frozen=True)
class TreeParams:
    budget: int = 64
    max_depth: int = 16
    max_branch: int = 8
    expand_batch: int = 16
    min_prob: float = 0.0  # only nodes at least this probable (cumulative draft probability) are expanded
    min_node_prob: float = 0.0  # only nodes at least this probable are proposed at all

    def __post_init__(self) -> None:
        for name, value in (("min_prob", self.min_prob), ("min_node_prob", self.min_node_prob)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name, value, limit in (
            ("budget", self.budget, MAX_BUDGET),
            ("max_depth", self.max_depth, MAX_TREE_DEPTH),
            ("max_branch", self.max_branch, 1024),
            ("expand_batch", self.expand_batch, MAX_BUDGET),
        ):
            if not 1 <= value <= limit:
                raise ValueError(f"{name} must be in [1, {limit}], got {value}")

    @property
    def shape(self) -> TreeParams:
        """These limits without the floors: what a `TreeBuilder`'s working arrays depend on."""
        return replace(self, min_prob=0.0, min_node_prob=0.0)

    @property
    def is_chain(self) -> bool:
        return self.max_branch == 1

    @staticmethod
    def chain(length: int, min_prob: float = 0.0, min_node_prob: float = 0.0) -> TreeParams:
        """Classic speculative decoding: the draft's greedy chain of `length` tokens."""
        return TreeParams(
            budget=length,
            max_depth=length,
            max_branch=1,
            expand_batch=1,
            min_prob=min_prob,
            min_node_prob=min_node_prob,
        )


class TreeError(ValueError):
    """A tree that breaks one of the structural rules; the message names the field and the limit."""


class TreeTooLarge(TreeError):
    """A tree over a size limit: the request was well-formed, the node will not spend that much on it."""


@dataclass(frozen=True)
class TokenTree:
    """NumPy arrays, so that a target node on llama.cpp never imports torch (about 180 MiB of RSS);
    anything array-like (a CPU torch tensor, a list) is taken as it comes, without a copy where it can."""

    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n]; parents[0] == -1
    logprobs: np.ndarray | None = None  # float32 [n], cumulative draft log-probability (root 0)

    def __post_init__(self) -> None:
        for name in ("tokens", "parents", "logprobs"):
            value: Any = getattr(self, name)
            if value is not None and not isinstance(value, np.ndarray):
                object.__setattr__(self, name, np.asarray(value))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def root_only(token: int) -> TokenTree:
        """The tree of autoregressive decoding: verify it and the target simply draws its next token."""
        return TokenTree(np.array([token], dtype=np.int64), np.array([-1], dtype=np.int64), np.zeros(1, np.float32))

    def best(self, count: int) -> TokenTree:
        """The root and the `count` nodes of highest cumulative log-probability (ties: the earlier
        node), in their order. A child never scores above its parent and comes after it, so these
        form a tree; logprobs that break that rule (a faulty draft) keep the tree whole."""
        if self.logprobs is None or not 0 <= count < self.size - 1:
            return self
        order = np.argsort(-self.logprobs[1:], kind="stable")[:count] + 1
        keep = np.zeros(self.size, dtype=bool)
        keep[0] = True
        keep[order] = True
        if not bool(keep[self.parents[order]].all()):
            return self
        ids = np.flatnonzero(keep)  # [count + 1], increasing
        remap = np.cumsum(keep) - 1  # old id -> new id, for kept nodes
        parents = self.parents[ids].copy()
        parents[1:] = remap[parents[1:]]
        return TokenTree(self.tokens[ids], parents, self.logprobs[ids])

    def walk(self, tokens: list[int]) -> list[int]:
        """Nodes (root first) along the path that spells a prefix of `tokens`, as far as it goes."""
        path, node = [0], 0
        for token in tokens:
            match = np.flatnonzero((self.parents == node) & (self.tokens == token))
            if match.size == 0:
                break
            node = int(match[0])
            path.append(node)
        return path

    def validate(self, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeStructure:
        """Check every rule a verifier relies on and return the derived structure."""
        tokens, parents = self.tokens, self.parents
        if tokens.ndim != 1 or parents.ndim != 1:
            raise TreeError("tree.tokens and tree.parents must be 1-D")
        n = tokens.shape[0]
        if n == 0:
            raise TreeError("tree is empty: it needs at least the root node")
        if n > max_nodes:
            raise TreeTooLarge(f"tree has {n} nodes, over the limit of {max_nodes}")
        if parents.shape[0] != n:
            raise TreeError(f"tree.parents has {parents.shape[0]} entries but tree.tokens has {n}")
        if self.logprobs is not None and self.logprobs.shape != (n,):
            raise TreeError(f"tree.logprobs has shape {tuple(self.logprobs.shape)}, expected ({n},)")
        if tokens.dtype != np.int64 or parents.dtype != np.int64:
            raise TreeError("tree.tokens and tree.parents must be int64")
        bad_token = (tokens < 0) | (tokens >= vocab_size)
        if bad_token.any():
            i = int(np.flatnonzero(bad_token)[0])
            raise TreeError(
                f"tree.tokens[{i}] = {int(tokens[i])} is outside the vocabulary [0, {vocab_size})"
            )
        if int(parents[0]) != -1:
            raise TreeError(f"tree.parents[0] must be -1 (the root), got {int(parents[0])}")
        index = np.arange(n)
        bad_parent = (parents[1:] < 0) | (parents[1:] >= index[1:])
        if bad_parent.any():
            i = int(np.flatnonzero(bad_parent)[0]) + 1
            raise TreeError(
                f"tree.parents[{i}] = {int(parents[i])} must be in [0, {i}): parents precede children"
            )
        structure = TreeStructure.from_parents(parents)
        depth = int(structure.depths.max())
        if depth > max_depth:
            raise TreeError(f"tree depth {depth} is over the limit of {max_depth}")
        return structure


@dataclass(frozen=True)
class TreeStructure:
    ancestors: np.ndarray  # bool [n, n]; ancestors[i, j] iff j is i or an ancestor of i
    depths: np.ndarray  # int64 [n]; root 0

    @staticmethod
    def from_parents(parents: np.ndarray) -> TreeStructure:
        """Depths by pointer jumping (log2(depth) vector steps), then ancestor rows one depth level at a
        time: each row is its parent's row plus itself, so every row is written once and no Python
        loop runs over nodes."""
        parents = np.asarray(parents)
        n = parents.shape[0]
        ptr = parents.clip(min=0)
        dist = (parents >= 0).astype(np.int64)
        while bool((ptr != 0).any()):
            dist = dist + dist[ptr]
            ptr = ptr[ptr]
        anc = np.zeros((n, n), dtype=bool)
        anc[0, 0] = True
        order = np.argsort(dist, kind="stable")
        counts = np.bincount(dist).tolist()
        start = counts[0]
        for count in counts[1:]:
            rows = order[start : start + count]
            anc[rows] = anc[parents[rows]]
            anc[rows, rows] = True
            start += count
        return TreeStructure(anc, dist)


def check_token_ids(tokens: list[int], vocab_size: int, field: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field} contains token id {bad[0]} outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class DraftedTree:
    """What a draft node returns for one step."""

    tree: TokenTree
    draft_forwards: int
    node_seconds: float | None = None  # the node's own (queue and build), as it reported it; None in process
    reused: bool = False  # grown from the search behind the previous tree (the draft node's lookahead)
