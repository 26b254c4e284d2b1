"""`--budget auto`: pick the draft's tree or chain that maximises expected tokens per second here.

Every verified tree is replayed. The target's draws depend only on (seed, position), so the tokens
it returned this step are the tokens it would have returned for any tree. That makes the accepted
length of every smaller candidate known exactly: the top B nodes of this tree (which is what the
builder returns for budget B) and the draft's greedy chain (the path of top children). The planner
keeps a running mean of those lengths per candidate. A tree larger than any seen is extrapolated
with SpecExec's own criterion: the summed draft probability S(B) of its B most probable nodes,
times a running calibration of observed over predicted acceptance. A chain longer than the greedy
path in the tree is extended with the greedy path's per-token acceptance rate.

The step time is the draft's catch-up pass plus its expansion forwards, and one target pass over
size + 1 tokens, read off the forward-time curves the nodes measured at start-up and scaled by
running observed/modelled ratios. Large trees win where a target pass costs the same for 1 and
1000 tokens (an offloaded GPU); small trees or plain chains on a CPU.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace

import torch

from common.profiling import interpolate
from common.tree import DraftedTree, TokenTree, TreeParams, TreeStructure

EMA = 0.2  # time scales and calibration
ACCEPT_EMA = 0.1  # per-candidate accepted lengths: noisier, so averaged over more steps
EXPLORE_EVERY = 8
MAX_CHAIN = 16


@dataclass(frozen=True)
class Candidate:
    kind: str  # "tree" or "chain"
    size: int  # budget, or chain length


@dataclass
class BudgetPlanner:
    target_curve: list[tuple[int, float]]
    draft_curve: list[tuple[int, float]]
    base: TreeParams  # its budget is the largest tree considered
    calibration: float = 1.0
    draft_scale: float = 1.0  # observed / modelled draft time (Python overhead, network, contention)
    target_scale: float = 1.0
    survival: torch.Tensor | None = None  # S(B) for B = 0..len-1
    depth: torch.Tensor | None = None  # deepest node among the top B, for B = 0..len-1
    history: list[Candidate] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # one planner serves every request of a gateway
        if not self.target_curve or not self.draft_curve:
            raise ValueError(
                "--budget auto needs forward-time curves from both nodes (start them with profiling on)"
            )
        self.expand_batch = free_batch(self.draft_curve)
        self.budgets = powers_of_two(self.base.budget) if self.base.max_branch > 1 else []
        self.chains = list(range(1, min(self.base.budget, self.base.max_depth, MAX_CHAIN) + 1))
        nan = float("nan")
        self.tree_accepted = [nan] * len(self.budgets)  # running means; nan until observed
        self.tree_forwards = [nan] * len(self.budgets)
        self.chain_accepted = [nan] * len(self.chains)
        self.greedy_hits, self.greedy_misses = 1.0, 1.0  # a weak prior on the chain's acceptance rate
        self.forwards_scale = 1.0  # observed / modelled expansion forwards of trees
        self.learned = False
        self.probe = self._probe()

    def candidates(self) -> list[Candidate]:
        return [Candidate("tree", b) for b in self.budgets] + [Candidate("chain", k) for k in self.chains]

    def params(self, c: Candidate) -> TreeParams:
        if c.kind == "chain":
            return TreeParams.chain(c.size)
        return replace(self.base, budget=c.size, expand_batch=self.expand_batch)

    def _probe(self) -> Candidate:
        """The first tree is built large enough to learn from, but no larger than 4 cheap steps cost."""
        if not self.budgets:
            return Candidate("chain", self.chains[-1])
        one = self.step_seconds(Candidate("tree", 1))
        fits = [b for b in self.budgets if self.step_seconds(Candidate("tree", b)) <= 4 * one]
        return Candidate("tree", max(fits, default=1))

    def draft_seconds(self, c: Candidate, forwards: float | None = None) -> float:
        """One pass to catch up on the tokens the last step accepted, whatever the shape; then the
        expansion forwards: one node each for a chain, up to expand_batch nodes each for a tree.

        A tree's forward count is the running mean seen at that budget, else one per level or per
        full batch. The catch-up pass must be modelled as fixed: folded into `draft_scale`, it would
        make every tree look as much dearer as the small ones the planner has been choosing."""
        one = interpolate(self.draft_curve, 1)
        if c.kind == "chain":
            return self.draft_scale * one * (1 + (c.size - 1 if forwards is None else forwards))
        if forwards is None:
            forwards = self.tree_forwards[self.budgets.index(c.size)]
            if math.isnan(forwards):
                forwards = self.forwards_scale * self._modelled_forwards(c.size)
        batch = min(self.expand_batch, c.size)
        return self.draft_scale * (one + forwards * interpolate(self.draft_curve, batch))

    def _modelled_forwards(self, budget: int) -> int:
        return max(self._depth(budget), math.ceil(budget / self.expand_batch))

    def target_seconds(self, size: int) -> float:
        return self.target_scale * interpolate(self.target_curve, size + 1)

    def step_seconds(self, c: Candidate) -> float:
        return self.draft_seconds(c) + self.target_seconds(c.size)

    def expected_tokens(self, c: Candidate) -> float:
        """The target's own token, plus the candidate's expected accepted length."""
        return 1.0 + self._accepted(c)

    def _accepted(self, c: Candidate) -> float:
        if c.kind == "chain":
            value = self.chain_accepted[c.size - 1]
            return value if not math.isnan(value) else self._greedy_run(0, c.size)
        i = self.budgets.index(c.size)
        if not math.isnan(self.tree_accepted[i]):
            return self.tree_accepted[i]
        seen = [j for j in range(i) if not math.isnan(self.tree_accepted[j])]
        known, known_size = (self.tree_accepted[seen[-1]], self.budgets[seen[-1]]) if seen else (0.0, 0)
        extra = self.calibration * (self._survival(c.size) - self._survival(known_size))
        return min(known + max(extra, 0.0), float(self._depth(c.size)))

    def _greedy_run(self, matched: int, length: int) -> float:
        """Expected accepted length of a greedy chain of `length` whose first `matched` tokens are
        known to be accepted: each further token is accepted with the greedy path's observed rate."""
        rate = self.greedy_hits / (self.greedy_hits + self.greedy_misses)
        return matched + sum(rate**i for i in range(1, length - matched + 1))

    def _survival(self, budget: int) -> float:
        if self.survival is None:
            return 0.0
        return float(self.survival[min(budget, len(self.survival) - 1)])

    def _depth(self, budget: int) -> int:
        if self.depth is None:
            return min(budget, self.base.max_depth)
        return int(self.depth[min(budget, len(self.depth) - 1)])

    def table(self) -> list[dict[str, float | str]]:
        rows: list[dict[str, float | str]] = []
        for c in self.candidates():
            seconds = self.step_seconds(c)
            tokens = self.expected_tokens(c)
            rows.append(
                dict(
                    shape=c.kind,
                    size=c.size,
                    draft_s=self.draft_seconds(c),
                    target_s=self.target_seconds(c.size),
                    expected_tokens=tokens,
                    tokens_per_s=tokens / seconds,
                )
            )
        return rows

    def best(self) -> Candidate:
        with self._lock:
            return self._best()

    def _best(self) -> Candidate:
        if not self.learned:
            return self.probe
        return max(self.candidates(), key=lambda c: self.expected_tokens(c) / self.step_seconds(c))

    def choose(self) -> TreeParams:
        """The best candidate by the model; every EXPLORE_EVERY steps a tree twice its size, so the
        planner keeps learning about trees beyond the sizes it has been choosing."""
        with self._lock:
            best = self._best()
            if self.budgets and len(self.history) % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                size = min(2 ** math.ceil(math.log2(2 * best.size)), self.base.budget)
                best = Candidate("tree", size)
            self.history.append(best)
            return self.params(best)

    def observe(
        self,
        params: TreeParams,
        drafted: DraftedTree,
        tokens: list[int],
        draft_seconds: float,
        target_seconds: float,
    ) -> None:
        """Learn from one step: `tokens` are what the target returned for `drafted` (accepted path
        and its own token), from a step that was not cut short by a stop or a length limit."""
        with self._lock:
            self._observe(params, drafted, tokens, draft_seconds, target_seconds)

    def _observe(
        self,
        params: TreeParams,
        drafted: DraftedTree,
        tokens: list[int],
        draft_seconds: float,
        target_seconds: float,
    ) -> None:
        tree = drafted.tree
        n = tree.size - 1
        if tree.logprobs is None or n < 1:
            return
        is_chain = params.max_branch == 1
        c = Candidate("chain" if is_chain else "tree", params.budget)
        structure = TreeStructure.from_parents(tree.parents)
        path = tree.walk(tokens)  # the accepted nodes
        self.draft_scale *= _ema_ratio(draft_seconds, self.draft_seconds(c, drafted.draft_forwards))
        self.target_scale *= _ema_ratio(target_seconds, self.target_seconds(n))
        self._replay_chains(tree, path)
        self.learned = True
        if is_chain:
            return
        if c.size in self.budgets:
            i = self.budgets.index(c.size)
            self.tree_forwards[i] = _mean(self.tree_forwards[i], drafted.draft_forwards, EMA)
            self.forwards_scale *= _ema_ratio(drafted.draft_forwards, self._modelled_forwards(c.size))
        order = torch.argsort(tree.logprobs[1:], descending=True, stable=True) + 1
        rank = torch.empty(n + 1, dtype=torch.long)
        rank[order] = torch.arange(1, n + 1)
        path_ranks = rank[torch.tensor(path[1:], dtype=torch.long)]
        for i, b in enumerate(self.budgets):
            if b <= n:  # the top b nodes of this tree are exactly the tree of budget b
                self.tree_accepted[i] = _mean(self.tree_accepted[i], int((path_ranks <= b).sum()), ACCEPT_EMA)
        self._learn_survival(tree, structure, order, accepted=len(path) - 1)

    def _replay_chains(self, tree: TokenTree, path: list[int]) -> None:
        """The draft's greedy chain is the path of top children; it would have accepted its common
        prefix with the accepted path. Past the end of that path in this tree, the rate fills in."""
        greedy = greedy_path(tree)
        matched = 0
        while matched < len(greedy) and matched + 1 < len(path) and greedy[matched] == path[matched + 1]:
            matched += 1
        self.greedy_hits = (1 - ACCEPT_EMA) * self.greedy_hits + matched
        self.greedy_misses = (1 - ACCEPT_EMA) * self.greedy_misses + (matched < len(greedy))
        for k in self.chains:
            if k <= len(greedy) or matched < len(greedy):
                value = float(min(k, matched))
            else:
                value = self._greedy_run(matched, k)
            self.chain_accepted[k - 1] = _mean(self.chain_accepted[k - 1], value, ACCEPT_EMA)

    def _learn_survival(
        self, tree: TokenTree, structure: TreeStructure, order: torch.Tensor, accepted: int
    ) -> None:
        assert tree.logprobs is not None
        n = tree.size - 1
        survival = torch.cat((torch.zeros(1), tree.logprobs[order].double().exp().cumsum(0).float()))
        depth = torch.cat((torch.zeros(1, dtype=torch.long), structure.depths[order].cummax(0).values))
        predicted = float(survival[-1])
        if predicted > 0:
            self.calibration += EMA * (accepted / predicted - self.calibration)
        if self.survival is not None and len(self.survival) > len(survival):
            # Keep the tail learned from a larger tree, re-anchored at this tree's size.
            tail = self.survival[len(survival) :] - self.survival[n] + survival[-1]
            survival = torch.cat((survival, tail))
            depth = torch.cat((depth, torch.maximum(self.depth[len(depth) :], depth[-1])))
        self.survival, self.depth = survival, depth


def greedy_path(tree: TokenTree) -> list[int]:
    """Nodes of the path that always takes the child the draft found most probable."""
    assert tree.logprobs is not None
    path, node = [], 0
    while True:
        children = (tree.parents == node).nonzero().squeeze(1)
        if children.numel() == 0:
            return path
        node = int(children[torch.argmax(tree.logprobs[children])])
        path.append(node)


def powers_of_two(limit: int) -> list[int]:
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return [*sizes, limit]


def free_batch(draft_curve: list[tuple[int, float]], slack: float = 1.25) -> int:
    """The largest expansion batch the draft runs in about the time of one token: expanding more nodes
    per forward is then free, and fewer forwards build the same tree."""
    one = interpolate(draft_curve, 1)
    return max((n for n, t in draft_curve if t <= slack * one), default=1)


def _mean(current: float, value: float, weight: float) -> float:
    return value if math.isnan(current) else current + weight * (value - current)


def _ema_ratio(observed: float, predicted: float) -> float:
    """Multiplier moving a scale EMA of the way towards observed / predicted."""
    if predicted <= 0 or observed <= 0:
        return 1.0
    return 1.0 + EMA * (observed / predicted - 1.0)
