"""`--budget auto`: pick the draft's tree or chain that maximises expected tokens per second here.

Every verified tree is replayed. The target's draws depend only on (seed, position), so the tokens
it returned this step are the tokens it would have returned for any tree. That makes the accepted
length of every smaller candidate known exactly: the top B nodes of this tree (which is what the
builder returns for budget B) and the draft's greedy chain (the path of top children). The planner
keeps a running mean of those lengths per candidate. A tree larger than any seen is extrapolated
with SpecExec's own criterion: the summed draft probability S(B) of its B most probable nodes,
times a running calibration of observed over predicted acceptance. A chain longer than the greedy
path in the tree is extended with the greedy path's per-token acceptance rate.

Candidates also differ in their confidence floor (`TreeParams.min_prob`): a floored tree stops
where the draft is unsure, so its size changes from step to step with the text. A tree built with
floor p replays every candidate with a floor of p or more, its size included; a floored candidate
is chosen only once replayed, and exploration lowers the floor a notch to refresh the ones below.

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

from common.profiling import interpolate, profile_sizes
from common.sampling import SamplingParams
from common.tree import DraftedTree, TokenTree, TreeParams, TreeStructure

EMA = 0.2  # time scales and calibration
ACCEPT_EMA = 0.1  # per-candidate accepted lengths: noisier, so averaged over about 10 steps
EXPLORE_EVERY = 16
MIN_SEEN = 2.0  # one replay moves a stale mean at most half way: a single lucky step is not a trend
MAX_CHAIN = 16
NEW_REQUEST_WEIGHT = 0.1  # what the observations of earlier requests count for in a new one
OPENING_KEEP = 0.8  # opening steps, one a request, are averaged over about the last 5 requests
MIN_PROBS = (0.3, 0.6)  # confidence floors tried besides none
GREEDY, SAMPLED = "greedy", "sampled"


@dataclass(frozen=True)
class Candidate:
    kind: str  # "tree" or "chain"
    size: int  # budget, or chain length
    depth: int  # depth limit; a chain's is its length
    min_prob: float = 0.0  # only nodes this probable are expanded: the step's tree follows confidence

    def __str__(self) -> str:
        shape = f"chain k={self.size}" if self.kind == "chain" else f"tree b={self.size} d={self.depth}"
        return shape + (f" p={self.min_prob:g}" if self.min_prob else "")


@dataclass
class AcceptanceStats:
    """What the planner learns about the text: how much of each candidate the target accepts. Each
    request learns on its own copy (see `BudgetPlanner.start`), and the copies are kept per sampling
    regime, as greedy decoding accepts far more than sampling from the same draft."""

    accepted: dict[Candidate, float] = field(default_factory=dict)  # running means of replayed lengths
    seen: dict[Candidate, float] = field(default_factory=dict)  # recent observations, decaying
    levels: dict[Candidate, float] = field(default_factory=dict)  # running means of levels expanded
    sizes: dict[Candidate, float] = field(default_factory=dict)  # running means of nodes proposed
    greedy_hits: float = 1.0  # a weak prior on the draft's greedy chain acceptance rate
    greedy_misses: float = 1.0
    calibration: float = 1.0  # observed / predicted acceptance of trees from S(B)
    survival: torch.Tensor | None = None  # S(B) for B = 0..len-1
    depth: torch.Tensor | None = None  # deepest node among the top B, for B = 0..len-1
    steps: int = 0  # proposals chosen, openings aside; a counter, not a list: a gateway runs for months

    def copy(self) -> AcceptanceStats:
        return replace(
            self,
            accepted=dict(self.accepted),
            seen=dict(self.seen),
            levels=dict(self.levels),
            sizes=dict(self.sizes),
        )


@dataclass
class OpeningStats:
    """How far the draft's greedy chain got on requests' opening steps, one a request, with a weak
    prior. Shared by a regime's requests, concurrent ones included: each request adds one step."""

    hits: float = 1.0
    misses: float = 1.0


def regime(sampling: SamplingParams) -> str:
    return GREEDY if sampling.temperature == 0 else SAMPLED


@dataclass
class BudgetPlanner:
    target_curve: list[tuple[int, float]]
    draft_curve: list[tuple[int, float]]
    base: TreeParams  # its budget and depth are the largest considered
    draft_scale: float = 1.0  # observed / modelled draft time (Python overhead, network, contention)
    target_scale: float = 1.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # one planner serves every request of a gateway
        if not self.target_curve or not self.draft_curve:
            raise ValueError(
                "--budget auto needs forward-time curves from both nodes (start them with profiling on)"
            )
        self.expand_batch = free_batch(self.draft_curve)
        base = self.base
        sizes = profile_sizes(base.budget)
        self.trees = (
            [Candidate("tree", b, base.max_depth, p) for p in (0.0, *MIN_PROBS) for b in sizes]
            if base.max_branch > 1
            else []
        )
        longest = min(base.budget, base.max_depth, MAX_CHAIN)
        self.chains = [Candidate("chain", k, k) for k in range(1, longest + 1)]
        self.chains += [Candidate("chain", k, k, p) for p in MIN_PROBS for k in (4, 8, 16) if k <= longest]
        self.forwards: dict[Candidate, float] = {}  # running means of expansion forwards, where built
        self.forwards_scale = 1.0  # observed / modelled expansion forwards of trees
        self.size_scales: dict[int, float] = {}  # per size built: what target_scale misses for it
        self._regimes = {GREEDY: AcceptanceStats()}  # per regime: the latest request's statistics
        self._openings: dict[str, OpeningStats] = {}
        self._stats = self._regimes[GREEDY]  # the request being served, switched under the lock
        self._opening = OpeningStats()
        self.probe = self._probe()

    def candidates(self) -> list[Candidate]:
        return self.trees + self.chains

    def params(self, c: Candidate) -> TreeParams:
        if c.kind == "chain":
            return TreeParams.chain(c.size, c.min_prob)
        return replace(
            self.base, budget=c.size, max_depth=c.depth, expand_batch=self.expand_batch, min_prob=c.min_prob
        )

    def _probe(self) -> Candidate:
        """The first tree is built large enough to learn from, but no larger than 4 cheap steps cost."""
        if not self.trees:
            return self.chains[-1]
        full = [c for c in self.trees if not c.min_prob]
        one = self.step_seconds(full[0])
        return max(
            (c for c in full if self.step_seconds(c) <= 4 * one), key=lambda c: c.size, default=full[0]
        )

    def draft_seconds(self, c: Candidate, forwards: float | None = None) -> float:
        """One pass to catch up on the tokens the last step accepted, whatever the shape; then the
        expansion forwards: one node each for a chain, up to expand_batch nodes each for a tree.

        The catch-up pass must be modelled as fixed: folded into `draft_scale`, it would make every
        tree look as much dearer as the small ones the planner has been choosing."""
        one = interpolate(self.draft_curve, 1)
        if c.kind == "chain":
            if forwards is None:
                forwards = self._size(c) - 1
            return self.draft_scale * one * (1 + forwards)
        if forwards is None:
            forwards = self.forwards.get(c, self.forwards_scale * self._modelled_forwards(c))
        batch = min(self.expand_batch, c.size)
        return self.draft_scale * (one + forwards * interpolate(self.draft_curve, batch))

    def _modelled_forwards(self, c: Candidate) -> float:
        """One forward per level the search expands (nodes at the depth limit never are), or per full
        batch, whichever is more."""
        levels = self._stats.levels.get(c, min(self._depth(c.size), c.depth - 1))
        return max(levels, math.ceil(self._size(c) / self.expand_batch))

    def _size(self, c: Candidate) -> float:
        """Nodes a step proposes: the budget, or fewer where the draft's confidence ran out first."""
        return self._stats.sizes.get(c, float(c.size))

    def target_seconds(self, size: int) -> float:
        """The start-up curve times two learned factors: `target_scale`, shared by all sizes, follows
        the machine's drift; a size's own factor follows what the curve misses for it. A verify step
        is more than the forward the curve timed, and on this CPU it grew faster with the tree (a
        16-node step cost 1.7x a one-token one, the curve said 1.4x): with one factor for all, the
        sizes the planner builds most set it, and every other size looks off by their error."""
        scale = self.target_scale * self.size_scales.get(size, 1.0)
        return scale * interpolate(self.target_curve, size + 1)

    def step_seconds(self, c: Candidate) -> float:
        return self.draft_seconds(c) + self._verify_seconds(c)

    def _verify_seconds(self, c: Candidate) -> float:
        """A candidate with a confidence floor proposes a different number of nodes each step."""
        size = self._size(c)
        low = math.floor(size)
        if low == size:
            return self.target_seconds(low)
        return (low + 1 - size) * self.target_seconds(low) + (size - low) * self.target_seconds(low + 1)

    def expected_tokens(self, c: Candidate) -> float:
        """The target's own token, plus the candidate's expected accepted length."""
        return 1.0 + self._accepted(c)

    def _accepted(self, c: Candidate) -> float:
        """A candidate's running mean, once any step could replay it.

        Means are not shrunk towards the smaller shapes a candidate contains: while the planner
        builds chains, no tree is replayed, and shrinking their stale means would keep it on chains
        (in `scripts/planner_sim.py` that cost 4% on prose). A mean lifted by noise is corrected
        by the steps that build it."""
        if c in self._stats.accepted:
            return self._stats.accepted[c]
        if c.kind == "chain":
            return self._greedy_run(0, c.size)
        # A tree holds every smaller one: start from the best seen below it, and add the calibrated
        # draft probability of the nodes it adds.
        known, known_size = max(((v, o.size) for o, v in self._observed_inside(c)), default=(0.0, 0))
        extra = self._stats.calibration * (self._survival(c.size) - self._survival(known_size))
        return min(known + max(extra, 0.0), float(min(self._depth(c.size), c.depth)))

    def _observed_inside(self, c: Candidate) -> list[tuple[Candidate, float]]:
        """Observed unfloored trees that tree `c` contains, with their means."""
        return [
            (o, v)
            for o, v in self._stats.accepted.items()
            if o != c and o.kind == "tree" and not o.min_prob and o.size <= c.size
        ]

    def _greedy_run(self, matched: int, length: int) -> float:
        """Expected accepted length of a greedy chain of `length` whose first `matched` tokens are
        known to be accepted: each further token is accepted with the greedy path's observed rate."""
        rate = self._stats.greedy_hits / (self._stats.greedy_hits + self._stats.greedy_misses)
        return matched + _run_beyond(rate, length - matched)

    def _survival(self, budget: int) -> float:
        if self._stats.survival is None:
            return 0.0
        return float(self._stats.survival[min(budget, len(self._stats.survival) - 1)])

    def _depth(self, budget: int) -> int:
        if self._stats.depth is None:
            return min(budget, self.base.max_depth)
        return int(self._stats.depth[min(budget, len(self._stats.depth) - 1)])

    def stats(self, regime: str = GREEDY) -> AcceptanceStats:
        with self._lock:
            return self._enter(regime)

    def _enter(self, regime: str, request: AcceptanceStats | None = None) -> AcceptanceStats:
        """Serve `request`'s statistics, or without one the regime's latest request's."""
        self._stats = request if request is not None else self._regimes.setdefault(regime, AcceptanceStats())
        self._opening = self._openings.setdefault(regime, OpeningStats())
        return self._stats

    def table(self, regime: str = GREEDY) -> list[dict[str, float | str]]:
        with self._lock:
            self._enter(regime)
            return self._table()

    def _table(self) -> list[dict[str, float | str]]:
        rows: list[dict[str, float | str]] = []
        for c in self._choosable():
            seconds = self.step_seconds(c)
            tokens = self.expected_tokens(c)
            rows.append(
                dict(
                    shape=c.kind,
                    size=c.size,
                    depth=c.depth,
                    draft_s=self.draft_seconds(c),
                    min_prob=c.min_prob,
                    target_s=self._verify_seconds(c),
                    expected_tokens=tokens,
                    tokens_per_s=tokens / seconds,
                )
            )
        return rows

    def best(self, regime: str = GREEDY) -> Candidate:
        with self._lock:
            self._enter(regime)
            return self._best()

    def _best(self) -> Candidate:
        if not self._stats.accepted:
            return self.probe
        return max(self._choosable(), key=lambda c: self.expected_tokens(c) / self.step_seconds(c))

    def _choosable(self) -> list[Candidate]:
        """A confidence floor changes what a tree holds in ways S(B) cannot say: replayed ones only."""
        return [c for c in self.candidates() if not c.min_prob or c in self._stats.accepted]

    def choose(
        self, regime: str = GREEDY, opening: bool = False, request: AcceptanceStats | None = None
    ) -> TreeParams:
        """The best candidate by the model; every EXPLORE_EVERY steps one a notch larger, so the
        planner keeps learning about the shapes just beyond the one it has been choosing.

        A request's `opening` step gets the chain that its own statistics favour (see `observe`):
        whatever the text, the draft guesses a reply's first tokens far worse than the rest.
        `request` is what `start` returned for the request being served."""
        with self._lock:
            self._enter(regime, request)
            if opening:
                plain = [c for c in self.chains if not c.min_prob]
                return self.params(max(plain, key=self._opening_speed))
            best = self._best()
            if self._stats.steps % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                best = self._explore(best)
            self._stats.steps += 1
            return self.params(best)

    def _opening_speed(self, c: Candidate) -> float:
        """Expected tokens per second of a chain on an opening step."""
        rate = self._opening.hits / (self._opening.hits + self._opening.misses)
        return (1 + _run_beyond(rate, c.size)) / self.step_seconds(c)

    def _explore(self, best: Candidate) -> Candidate:
        """Twice the nodes and a floor a notch lower: a tree that holds `best` and every candidate a
        notch beyond it, so one step's replay refreshes all of them. Cheap next to a blind jump to the
        largest tree, which on a CPU costs several ordinary steps."""
        if not self.trees:
            return self.chains[min(best.size, len(self.chains) - 1)]
        size = min(2 ** math.ceil(math.log2(2 * best.size)), self.base.budget)
        floors = (0.0, *MIN_PROBS)
        lower = floors[max(floors.index(best.min_prob) - 1, 0)] if best.min_prob in floors else 0.0
        return Candidate("tree", size, self.base.max_depth, lower)

    def observe(
        self,
        params: TreeParams,
        drafted: DraftedTree,
        tokens: list[int],
        draft_seconds: float,
        target_seconds: float,
        regime: str = GREEDY,
        opening: bool = False,
        request: AcceptanceStats | None = None,
    ) -> None:
        """Learn from one step: `tokens` are what the target returned for `drafted` (accepted path
        and its own token), from a step that was not cut short by a stop or a length limit.

        An `opening` step (a request's first) teaches only how the greedy chain does on opening
        steps. Its times include both models' pass over the prompt, and it proposes the reply's
        first tokens, which the draft guesses far worse than the rest (the bench's code prompts:
        none of the first step accepted, against about 6 tokens a step after it, at budget 8)."""
        with self._lock:
            self._enter(regime, request)
            tree = drafted.tree
            n = tree.size - 1
            if tree.logprobs is None or n < 1:
                return
            if opening:
                self._learn_opening(tree, tree.walk(tokens))
                return
            self._regimes[regime] = self._stats  # the next request starts from the one learning now
            is_chain = params.is_chain
            built = Candidate(
                "chain" if is_chain else "tree", params.budget, params.max_depth, params.min_prob
            )
            self.draft_scale *= _ema_ratio(draft_seconds, self.draft_seconds(built, drafted.draft_forwards))
            target_fit = _ema_ratio(target_seconds, self.target_seconds(n))
            self.target_scale *= target_fit
            self.size_scales[n] = self.size_scales.get(n, 1.0) * target_fit
            path = tree.walk(tokens)  # the accepted nodes, root first
            for c in self._stats.seen:
                self._stats.seen[c] *= 1 - ACCEPT_EMA
            self._replay_chain(tree, path)
            if is_chain or (params.max_branch, params.max_depth) != (
                self.base.max_branch,
                self.base.max_depth,
            ):
                return
            self.forwards[built] = _mean(self.forwards.get(built, math.nan), drafted.draft_forwards, EMA)
            modelled = self.forwards_scale * self._modelled_forwards(built)
            self.forwards_scale *= _ema_ratio(drafted.draft_forwards, modelled)
            structure = TreeStructure.from_parents(tree.parents)
            order = torch.argsort(tree.logprobs[1:], descending=True, stable=True) + 1  # best node first
            self._replay_trees(tree, structure, order, path, n == params.budget, params.min_prob)
            if not params.min_prob:
                self._learn_survival(tree, structure, order, accepted=len(path) - 1)

    def _replay_trees(
        self,
        tree: TokenTree,
        structure: TreeStructure,
        order: torch.Tensor,
        path: list[int],
        complete: bool,
        min_prob: float,
    ) -> None:
        """The tree of budget b and floor p is the top b nodes whose parent is at least p probable. This
        tree, built with a floor no higher than p, holds them all when it was built with floor p, when
        it holds every node its search could reach (`complete` False), when the b-th best of them
        still beats the worst node it kept, or when its own top b nodes all meet the floor anyway."""
        assert tree.logprobs is not None
        scores, depths = tree.logprobs, structure.depths
        worst = float(scores[order[-1]]) if complete else -math.inf
        on_path = torch.tensor(path[1:], dtype=torch.long)
        parent_scores = scores[tree.parents.clamp(min=0)]
        opens = depths < self.base.max_depth
        for p in sorted({c.min_prob for c in self.trees if c.min_prob >= min_prob}):
            floor = math.log(p) if p else -math.inf
            eligible = parent_scores >= floor
            within = order[eligible[order]]
            rank = torch.full((tree.size,), tree.size + 1, dtype=torch.long)
            rank[within] = torch.arange(1, within.numel() + 1)
            path_ranks = rank[on_path]
            # Levels the search expands: the deepest node it keeps that may have children.
            opened = torch.where((scores[within] >= floor) & opens[within], depths[within], 0)
            levels = torch.cat((torch.zeros(1, dtype=torch.long), opened.cummax(0).values))
            outside = torch.cat((torch.zeros(1, dtype=torch.long), (~eligible[order]).cumsum(0)))
            for c in self.trees:
                if c.min_prob != p:
                    continue
                held = c.size <= within.numel() and (
                    p == min_prob or float(scores[within[c.size - 1]]) > worst or int(outside[c.size]) == 0
                )
                if not (held or worst == -math.inf):
                    continue
                b = min(c.size, within.numel())
                self._record(c, int((path_ranks <= b).sum()))
                stats = self._stats
                stats.levels[c] = _mean(stats.levels.get(c, math.nan), int(levels[b]), ACCEPT_EMA)
                stats.sizes[c] = _mean(stats.sizes.get(c, math.nan), b, ACCEPT_EMA)

    def _learn_opening(self, tree: TokenTree, path: list[int]) -> None:
        greedy = greedy_path(tree)
        matched = _matched(greedy, path)
        o = self._opening
        o.hits = OPENING_KEEP * o.hits + matched
        o.misses = OPENING_KEEP * o.misses + (matched < len(greedy))

    def _replay_chain(self, tree: TokenTree, path: list[int]) -> None:
        """The draft's greedy chain is the path of top children; it would have accepted its common
        prefix with the accepted path. A chain with a floor p stops after its first node less than p
        probable, where the tree shows one. Past the end of the greedy path in this tree, the rate
        fills in."""
        assert tree.logprobs is not None
        greedy = greedy_path(tree)
        matched = _matched(greedy, path)
        self._stats.greedy_hits = (1 - ACCEPT_EMA) * self._stats.greedy_hits + matched
        self._stats.greedy_misses = (1 - ACCEPT_EMA) * self._stats.greedy_misses + (matched < len(greedy))
        scores = tree.logprobs[torch.tensor(greedy, dtype=torch.long)]
        for c in self.chains:
            length = c.size
            if c.min_prob:
                below = (scores < math.log(c.min_prob)).nonzero()
                if below.numel():  # else, where the tree ended first, the chain is taken to run its length
                    length = min(c.size, int(below[0]) + 1)
                self._stats.sizes[c] = _mean(self._stats.sizes.get(c, math.nan), length, ACCEPT_EMA)
            if length <= len(greedy) or matched < len(greedy):
                value = float(min(length, matched))
            else:
                value = self._greedy_run(matched, length)
            self._record(c, value)

    def _record(self, c: Candidate, accepted: float) -> None:
        """An exponentially weighted mean: the weight of a new value is one over the decayed count of
        observations, so a candidate not seen for a while (or since a new request began) adapts fast,
        though never more than half way on one value (`MIN_SEEN`)."""
        s = self._stats
        s.seen[c] = s.seen.get(c, 0.0) + 1.0
        s.accepted[c] = _mean(s.accepted.get(c, math.nan), accepted, 1.0 / max(s.seen[c], MIN_SEEN))

    def start(self, regime: str = GREEDY) -> AcceptanceStats:
        """A new request, whose statistics to pass to `choose` and `observe`: a copy of those of the
        request that learned last, so concurrent requests on a gateway each learn on their own text,
        and the next request starts from the most recent text. Its text may differ from the last
        one's, so what was learned counts for less, and its first step after the opening explores,
        so estimates carried over from other text are replayed at once."""
        with self._lock:
            stats = self._enter(regime).copy()
            for c in stats.seen:
                stats.seen[c] *= NEW_REQUEST_WEIGHT
            stats.greedy_hits *= NEW_REQUEST_WEIGHT
            stats.greedy_misses *= NEW_REQUEST_WEIGHT
            if stats.accepted:
                stats.steps = EXPLORE_EVERY - 1
            self._regimes[regime] = self._stats = stats
            return stats

    def _learn_survival(
        self, tree: TokenTree, structure: TreeStructure, order: torch.Tensor, accepted: int
    ) -> None:
        assert tree.logprobs is not None
        n = tree.size - 1
        survival = torch.cat((torch.zeros(1), tree.logprobs[order].double().exp().cumsum(0).float()))
        depth = torch.cat((torch.zeros(1, dtype=torch.long), structure.depths[order].cummax(0).values))
        predicted = float(survival[-1])
        if predicted > 0:
            self._stats.calibration += EMA * (accepted / predicted - self._stats.calibration)
        if self._stats.survival is not None and len(self._stats.survival) > len(survival):
            # Keep the tail learned from a larger tree, re-anchored at this tree's size.
            tail = self._stats.survival[len(survival) :] - self._stats.survival[n] + survival[-1]
            survival = torch.cat((survival, tail))
            depth = torch.cat((depth, torch.maximum(self._stats.depth[len(depth) :], depth[-1])))
        self._stats.survival, self._stats.depth = survival, depth


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


def _run_beyond(rate: float, length: int) -> float:
    """Expected accepted length of `length` more chain tokens, each accepted with `rate`."""
    return sum(rate**i for i in range(1, length + 1))


def _matched(greedy: list[int], path: list[int]) -> int:
    """How many of the greedy chain's nodes the accepted path (root first) begins with."""
    matched = 0
    while matched < len(greedy) and matched + 1 < len(path) and greedy[matched] == path[matched + 1]:
        matched += 1
    return matched


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
