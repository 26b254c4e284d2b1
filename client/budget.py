"""`--budget auto`: grow each step's tree while a node is worth what it costs at the running rate.

Every step sets two thresholds on a node's cumulative draft probability q, from the running rate R
(tokens per second), the calibration c (accepted over proposed probability) and the nodes'
forward-time curves: expand a node when c·q > K_LEVEL·R·(level + children·slope), propose it when
c·q > K_NODE·R·slope; `--max-budget` stays the cap. The design, its constants and the runs behind
them: docs/planner.md.

With a draft node that searches ahead while the target verifies (its lookahead), a step whose tree
it re-roots waits only for what the search had left to do: the level cost then counts only the
exposed share of the draft's time, from the re-root hit rate and the share of a re-rooted tree's
work the search had done, as measured. In one process nothing is hidden, no tree is re-rooted, and
the share stays 1.

What a pass costs is read at the sizes the target measured, not between them: on a CPU the cost
is not smooth in the rows (llama.cpp multiplies rows in blocks of 4, each leftover row alone), so
each tree is cut to the measured pass size worth most (`fit`), from candidates the draft proposes
below the node floor.

A target serving several sessions runs their trees in one pass (common.runtime.batching). With k
sessions sharing each pass, a tree token costs the pass k times its own slope, since each of the
others' trees grows alike: the target's cost per tree token is read at k times the tree's size, so
trees shrink under load where the pass is flat (a GPU) and keep their size where it is linear.
Whether to draft at all is then judged by what the pass commits for all its sessions: a tree's
nodes lengthen the pass for every other session in it, each committing about as many tokens a pass
as this one, so a drafted step counts their time at that rate as its own (`RegimeStats.imposed`).
What a regime's means say holds at the load they were learned at: each load class (about 1, 2, 4
or 8 sessions a pass) keeps its own, and a request whose load changes class takes up the new
class's means (`LOAD_CLASSES`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams
from common.model.profiling import interpolate

K_LEVEL = 1.25  # above 1: the rate a step must beat is a mean, and the better steps beat it
K_NODE = 1.0  # a node pays for its place in the pass; measured above 1 it kept chat and prose trees too small
EMA = 0.05  # rate and calibration: about 20 steps
PRIOR_STEPS = 4  # means start as about 3 steps' worth: steps weigh 1/4, 1/5, ... until that falls to EMA
SCALE_EMA = 0.2  # observed over modelled times follow the machine's drift faster
MAX_FLOOR = 0.95  # a step always proposes the draft's likeliest next tokens
SLOPE_SPAN = 16  # tree tokens the target's cost per token is measured over, at the least
FIT_CANDIDATES = 4  # a tree to fit brings nodes down to this fraction of the node floor, to round up to
FIT_MAX_SHARING = 1.5  # past this many sessions a pass, the pass's rows are not one tree's: no fitting
EXPLORE_EVERY = 8  # while trees do not pay, one step in this many still drafts, to notice when they do
EXPLORE_MAX = 32  # the gap doubles after each such step that did not pay, up to this
TRIALS_DECLINED = 3  # after this many requests in a row whose trees did not pay, a request skips its trial
EXPLORE_DECLINED_MAX = 128  # then the exploring gap counts the regime's steps across requests, up to this
GREEDY, SAMPLED = "greedy", "sampled"
# Sessions a target pass serves, in classes whose running means are kept apart: a drafted step's rate
# learned with one session a pass says little of it with eight (a CPU's pass of eight trees costs
# about twice one's), and eight requests that began a burst with the means of single requests drafted
# for about 30 steps each before their own steps outweighed them. The load moves to the nearest
# class once it is LOAD_HYSTERESIS times away from its own, so it does not flap at a border.
LOAD_CLASSES = (1, 2, 4, 8)
LOAD_HYSTERESIS = 1.68
# Under load (a class above 1) a drafted step must beat the target alone by this much: it costs the
# others more than its rows in their pass (its session sits out the pass in flight while it drafts,
# and the draft serves every session), and trees that about broke even for their own requests cost
# an 8-client burst on the EPYC's bf16 target ~5% of its throughput (docs/planner.md).
LOAD_MARGIN = 1.25


def regime(sampling: SamplingParams) -> str:
    return GREEDY if sampling.temperature == 0 else SAMPLED


@dataclass
class RegimeStats:
    """Running means per step of one sampling regime, or of one request in it: greedy decoding accepts
    far more than sampling from the same draft, so the two learn apart."""

    tokens: float  # returned by the target
    seconds: float  # draft + target
    accepted: float = 1.0  # nodes the target accepted
    predicted: float = 1.0  # the draft's probability mass of the nodes proposed
    batch: float = 1.0  # nodes per expansion forward
    children: float = 2.0  # nodes proposed per node expanded
    size: float = 8.0  # nodes proposed
    reused: float = 0.0  # share of trees the draft grew from its lookahead search (re-rooted)
    hidden: float = 0.0  # share of a re-rooted tree's draft work its search had done before the request
    rerooted: int = 0  # re-rooted trees learned from
    imposed: float = 0.0  # seconds a step's tree cost the other sessions of its pass, at this step's tokens each
    alone: float = 0.0  # seconds per token of steps run on the target alone; 0: not measured yet
    alone_steps: int = 0
    skipped: int = 0  # steps in a row the draft was left out of (a regime's: while trials are skipped)
    explore: int = EXPLORE_EVERY  # steps on the target alone before the next exploring draft
    trial: bool = True  # a request's first PRIOR_STEPS steps draft, whatever the regime learned
    judged: bool = False  # a request's verdict on its trees is in the regime's `declined`
    declined: int = 0  # the regime's requests in a row whose trees did not pay
    steps: int = 0  # learned from
    trees: int = 0  # learned from that proposed nodes
    load: int = 1  # the load class (LOAD_CLASSES) whose means these are

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def shared_rate(self) -> float:
        """Tokens per second of the step's own time and of what its tree cost the pass's other sessions:
        against the target alone's rate, a tree pays where its accepted nodes outweigh what its rows
        cost every token the pass commits."""
        return self.tokens / (self.seconds + self.imposed)

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted

    def learn(self, tokens: int, seconds: float, shape: StepShape | None, imposed: float = 0.0) -> None:
        """A running mean over the first steps, then an exponential one: a request's means move to
        its own text within a few steps, then follow it over about 20. The tree's means count only
        steps that proposed a tree, so empty steps on text the draft cannot guess do not hold the
        inherited calibration in place. A request that skipped its trial takes its first drafted
        step's rate as its own: only its text can overturn the verdict it inherited. Called under
        the planner's lock."""
        w = 1.0 if not self.trial and self.steps == 0 else max(EMA, 1.0 / (PRIOR_STEPS + self.steps))
        self.steps += 1
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.imposed += w * (imposed - self.imposed)
        if shape is None:
            return
        w = max(EMA, 1.0 / (PRIOR_STEPS + self.trees))
        self.trees += 1
        self.accepted += w * (shape.accepted - self.accepted)
        self.predicted += w * (shape.predicted - self.predicted)
        self.size += w * (shape.size - self.size)
        if shape.batch is not None:
            self.batch += w * (shape.batch - self.batch)
        self.children += w * (shape.children - self.children)
        self.reused += w * (shape.reused - self.reused)
        if shape.hidden is not None:
            w = max(EMA, 1.0 / (1 + self.rerooted))
            self.rerooted += 1
            self.hidden += w * (shape.hidden - self.hidden)


@dataclass(frozen=True)
class StepShape:
    """What one step's tree proposed and how much of it the target took."""

    accepted: int
    predicted: float  # the draft's probability mass of the nodes proposed
    size: int
    batch: float | None  # nodes per expansion forward, if it expanded any
    children: float  # nodes proposed per node expanded
    reused: bool = False  # grown from the draft's lookahead search
    hidden: float | None = None  # re-rooted: the share of its fresh build's time the step did not wait for


@dataclass(frozen=True)
class Thresholds:
    """One step's choice and the numbers behind it (`specexec profile` prints them)."""

    rate: float
    calibration: float
    level_seconds: float
    slope_seconds: float
    params: TreeParams
    exposed: float = 1.0  # share of the draft's time not hidden behind the target's pass


@dataclass
class BudgetPlanner:
    target_curve: list[tuple[int, float]]
    draft_curve: list[tuple[int, float]]
    base: TreeParams  # the cap: its budget, depth and branching bound every tree
    draft_scale: float = 1.0  # observed / modelled draft time (Python overhead, network, contention)
    target_scale: float = 1.0
    sharing: float = 1.0  # sessions per target pass, as the target reports them (continuous batching)
    load: int = 1  # `sharing`'s class (LOAD_CLASSES): the regime means that steps now learn and read
    k_level: float = K_LEVEL  # per planner, so benchmarks/auto_constants.py can race variants side by side
    k_node: float = K_NODE
    fit_trees: bool = True  # cut trees to measured pass sizes (`fit`); off: benchmarks race the two
    explore_backoff: bool = True  # exploring drafts grow apart while they do not pay; off: the A/B
    trials_declined: int = TRIALS_DECLINED  # a huge number: every request tries trees first (the A/B)
    explore_across: bool = True  # declined requests explore on the regime's count; off: each its own (the A/B)
    load_margin: float = LOAD_MARGIN  # 1.0: a tree under load need only beat the target alone (the A/B)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # one planner serves every request of a gateway
        if not self.target_curve or not self.draft_curve:
            raise ValueError(
                "--budget auto needs forward-time curves from both nodes (start them with profiling on)"
            )
        self.expand_batch = min(free_batch(self.draft_curve), self.base.budget)
        self._regimes: dict[str, RegimeStats] = {}

    def stats(self, regime: str = GREEDY) -> RegimeStats:
        with self._lock:
            return replace(self._stats(regime))

    def start(self, regime: str = GREEDY) -> RegimeStats:
        """A request's own running means, starting from what earlier requests of its regime taught.
        It tries trees on its own text first (`draft_pays`) unless TRIALS_DECLINED requests in a row
        found they did not pay: then the pair, not the text, is why, and it starts on the target
        alone, drafting only to explore (`draft_pays`)."""
        with self._lock:
            return self._start(self._stats(regime))

    def _start(self, shared: RegimeStats) -> RegimeStats:
        trial = shared.declined < self.trials_declined
        return replace(shared, steps=0, trees=0, skipped=0, judged=False, trial=trial,
                       explore=EXPLORE_EVERY if trial else 2 * EXPLORE_EVERY)  # fmt: skip

    def _request(self, regime: str, request: RegimeStats | None) -> tuple[RegimeStats, RegimeStats]:
        """The regime's means at the present load, and the request's own (the regime's if None): a
        request whose load changed class starts again from the new class's means, as a new request
        would (its trial too, unless that class declined trees). Called under the planner's lock."""
        shared = self._stats(regime)
        if request is None:
            return shared, shared
        if request.load != shared.load:
            fresh = self._start(shared)
            for f in fields(RegimeStats):
                setattr(request, f.name, getattr(fresh, f.name))
        return shared, request

    def snapshot(self) -> dict[str, Any]:
        """What this planner learned about the pair, as plain data (client.planner_state). The
        sessions per pass are left out: they describe the load of the moment, not the pair."""
        with self._lock:
            regimes = {name: {k: _plain(v) for k, v in asdict(s).items()} for name, s in self._regimes.items()}
            return {"draft_scale": float(self.draft_scale), "target_scale": float(self.target_scale), "regimes": regimes}

    def restore(self, state: dict[str, Any]) -> None:
        """Take up a snapshot of a planner on the same pair; ValueError, and this planner unchanged,
        if any part of it is not one."""
        scales = [state["draft_scale"], state["target_scale"]]
        if not all(isinstance(x, float | int) and math.isfinite(x) and x > 0 for x in scales):
            raise ValueError(f"scales must be positive numbers, got {scales}")
        regimes = {}
        names = {_key(r, c): c for r in (GREEDY, SAMPLED) for c in LOAD_CLASSES}
        for name, values in dict(state["regimes"]).items():
            if name not in names or set(values) != {f.name for f in fields(RegimeStats)}:
                raise ValueError(f"regime {name!r} is not one this planner keeps")
            stats = RegimeStats(**values)
            if stats.load != names[name]:
                raise ValueError(f"regime {name!r} holds the means of load class {stats.load}")
            numbers = [getattr(stats, f.name) for f in fields(RegimeStats)]
            if not all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in numbers):
                raise ValueError(f"regime {name!r} holds a value that is not a count or a mean")
            if min(stats.tokens, stats.seconds, stats.predicted) <= 0:
                raise ValueError(f"regime {name!r} has a rate or calibration out of range")
            regimes[name] = stats
        with self._lock:
            self.draft_scale, self.target_scale = float(scales[0]), float(scales[1])
            self._regimes = regimes

    def _stats(self, regime: str) -> RegimeStats:
        """The regime's means at the present load class. A regime starts at the target alone's rate
        there: a pessimistic rate grows large first trees, which teach the calibration most, until its
        first few steps replace it. It takes the lighter classes' verdict against trees: trees that
        did not pay with fewer sessions a pass seldom pay with more (each costs the others too, and
        the draft serves more), so a burst's requests skip their trial, and the class's exploring
        drafts judge it afresh."""
        key = _key(regime, self.load)
        if key not in self._regimes:
            seconds = interpolate(self.target_curve, self.load)
            lighter = [self._regimes.get(_key(regime, c)) for c in LOAD_CLASSES if c < self.load]
            declined = max((s.declined for s in lighter if s is not None), default=0)
            explore = 2 * EXPLORE_EVERY if declined >= self.trials_declined else EXPLORE_EVERY
            self._regimes[key] = RegimeStats(tokens=1.0, seconds=seconds, load=self.load, declined=declined,
                                             explore=explore)  # fmt: skip
        return self._regimes[key]

    def thresholds(self, regime: str = GREEDY, request: RegimeStats | None = None) -> Thresholds:
        with self._lock:
            return self._thresholds(self._request(regime, request)[1])

    def _thresholds(self, s: RegimeStats) -> Thresholds:
        """The target's cost per tree token is its curve's mean slope over at least SLOPE_SPAN tokens
        past a tree's first node: between 1 and 2 tokens the curve is a difference of two noisy
        timings, and a slope read there (where small trees would put it) raised the node floor, which
        shrank the trees further, until steps proposed nothing. The step from 1 token to 2 is paid by
        any tree, and is the whole cost of one where llama.cpp computes a token on the CPU and streams
        every tree to the GPU (0.057 s, then 0.096 s for 2 tokens and 0.104 s for 16): whether a tree
        pays at all is decided apart (`draft_pays`). A node worth expanding is worth proposing: the
        node floor never exceeds the expansion floor."""
        span = min(max(s.size, float(SLOPE_SPAN)), float(self.base.budget))
        k = self.sharing
        grown = interpolate(self.target_curve, k * (span + 1)) - interpolate(self.target_curve, 2 * k)
        slope = self.target_scale * max(grown, 0.0) / (span - 1)
        exposed = self._exposed(s)
        level = exposed * self.draft_scale * interpolate(self.draft_curve, max(s.batch, 1.0)) + s.children * slope
        value = s.rate / max(s.calibration, 1e-3)  # seconds -> probability the draft must give a node
        min_prob = min(MAX_FLOOR, self.k_level * value * level)
        node_floor = min(min_prob, self.k_node * value * slope) / (FIT_CANDIDATES if self._fits() else 1)
        params = replace(
            self.base, expand_batch=self.expand_batch, min_prob=round(min_prob, 4), min_node_prob=round(node_floor, 4)
        )
        return Thresholds(s.rate, s.calibration, level, slope, params, exposed)

    def _fits(self) -> bool:
        return self.fit_trees and self.sharing <= FIT_MAX_SHARING

    def fit(
        self, tree: TokenTree, pending: int = 0, regime: str = GREEDY, request: RegimeStats | None = None
    ) -> TokenTree:
        """The tree cut to its m likeliest nodes, for the m that maximises their probability mass less
        the pass's cost at the running rate (the node floor's rule, over whole passes). The pass's
        rows (`pending` chain tokens, the root and m nodes) are cut only to sizes the target
        measured: between two of them the cost is a guess, and on a CPU it can exceed both. The
        whole tree and the root alone are candidates too. Not where the pass is shared: other
        sessions' rows count too."""
        if not self._fits() or tree.logprobs is None or tree.size <= 1:
            return tree
        with self._lock:
            s = self._request(regime, request)[1]
            value = self.k_node * self.target_scale * s.rate / max(s.calibration, 1e-3)
        sizes = np.array([n for n, _ in self.target_curve], dtype=np.int64)
        costs = np.array([t for _, t in self.target_curve], dtype=np.float64)
        nodes = sizes - 1 - pending  # [points]: tree nodes besides the root at each measured size
        ok = (nodes > 0) & (nodes < tree.size - 1)
        ends = [interpolate(self.target_curve, pending + rows) for rows in (1, tree.size)]
        nodes = np.concatenate(([0], nodes[ok], [tree.size - 1]))  # [c]: candidates
        costs = np.concatenate((ends[:1], costs[ok], ends[1:]))  # [c]
        mass = np.concatenate(([0.0], np.cumsum(np.sort(np.exp(tree.logprobs[1:].astype(np.float64)))[::-1])))
        best = int(nodes[(mass[nodes] - value * costs).argmax()])  # the first of equals: the smaller tree
        return tree if best == tree.size - 1 else tree.best(best)

    def _exposed(self, s: RegimeStats) -> float:
        """The share of the draft's time a step waits for: all of it on a tree the search missed, and
        on a re-rooted one what the search had left to do. That is measured, not assumed to be the
        part past the target's pass: the search grows below every node verification might end on,
        so little of it may lie below the one it does (on the EPYC, re-rooted code trees still took
        3-7 of the draft's forwards, 66-158 ms, while re-rooted prose trees took 5-13 ms)."""
        return (1.0 - s.reused) + s.reused * (1.0 - s.hidden)

    def choose(self, regime: str = GREEDY, request: RegimeStats | None = None) -> TreeParams:
        return self.thresholds(regime, request).params

    def draft_pays(self, regime: str = GREEDY, request: RegimeStats | None = None) -> bool:
        """Whether this step should draft at all. Where trees do not pay for themselves (a target
        whose pass grows steeply with the tree, text the draft cannot guess), the running rate of
        drafted steps stays below the target alone's: the step then runs on the target alone, and
        one in EXPLORE_EVERY drafts anyway, so the rate is measured again and trees come back when
        the text turns predictable. A request's first few steps draft: inheriting the last request's
        verdict kept code requests that followed prose on the target alone (home lab,
        docs/benchmarks.md). Not once TRIALS_DECLINED requests in a row found that trees do not pay
        (a target whose one-token pass is fast against the draft's, docs/planner.md): each trial cost
        a request about a sixth of its speed in one process. Their requests then explore on one
        count of the regime's steps, first after twice the usual gap, the gap doubling up to
        EXPLORE_DECLINED_MAX: two exploring drafts in each 64-token request, each mostly the
        draft's first pass over its prompt, still cost it about 5% there. Where k sessions share the
        target's passes, each explores k times as rarely: an exploring tree's rows delay every session
        of its pass, and the pass then carries one about as often as with one session; and a drafted
        step must beat the target alone by LOAD_MARGIN."""
        with self._lock:
            shared, s = self._request(regime, request)
            if s.trial and s.steps < PRIOR_STEPS:
                return True
            alone = s.alone or self.target_scale * interpolate(self.target_curve, self.sharing)
            pays = s.shared_rate >= (self.load_margin if self.load > 1 else 1.0) / alone
            if pays or not s.judged:
                s.judged = True
                shared.declined = 0 if pays else shared.declined + 1
                if shared.declined == self.trials_declined:
                    shared.skipped, shared.explore = 0, 2 * EXPLORE_EVERY
            if pays:
                s.skipped, s.explore = 0, EXPLORE_EVERY
                return True
            gap, most = (s, EXPLORE_MAX) if s.trial or not self.explore_across else (shared, EXPLORE_DECLINED_MAX)
            gap.skipped += 1
            if gap.skipped >= self._explore_after(gap):
                gap.skipped = 0
                if self.explore_backoff:
                    gap.explore = min(2 * gap.explore, most)
                return True
            return False

    def alone_run(self, regime: str = GREEDY, request: RegimeStats | None = None, most: int = 1) -> int:
        """How many steps, from one that `draft_pays` has just left on the target alone, will run alone
        before its next exploring draft if nothing new is learned meanwhile, up to `most`: the client
        runs them as one call to the target, and they count as skipped now."""
        with self._lock:
            shared, s = self._request(regime, request)
            gap = s if s.trial or not self.explore_across else shared
            run = max(1, min(most, self._explore_after(gap) - gap.skipped))
            gap.skipped += run - 1
            return run

    def observe_sharing(self, pass_sessions: int) -> None:
        """Learn only the sessions a pass served, from a step whose times teach nothing (a request's
        first, over its prompt): a burst of requests then sizes its first trees for the load."""
        with self._lock:
            self._learn_sharing(pass_sessions)

    def _learn_sharing(self, pass_sessions: int) -> None:
        """Called under the planner's lock."""
        self.sharing += SCALE_EMA * (max(pass_sessions, 1) - self.sharing)
        if abs(math.log(self.sharing / self.load)) > math.log(LOAD_HYSTERESIS):
            self.load = min(LOAD_CLASSES, key=lambda c: abs(math.log(self.sharing / c)))

    def _explore_after(self, gap: RegimeStats) -> int:
        return gap.explore * max(1, round(self.sharing))

    def observe_alone(
        self,
        tokens: int,
        seconds: float,
        regime: str = GREEDY,
        request: RegimeStats | None = None,
        pass_sessions: int = 1,
    ) -> None:
        """Learn the target alone's seconds per token from a step the draft was left out of, and the
        sessions its pass served: under load most steps may run alone."""
        if tokens < 1:
            return
        with self._lock:
            self._learn_sharing(pass_sessions)
            for s in _both(*self._request(regime, request)):
                w = max(EMA, 1.0 / (1 + s.alone_steps))
                s.alone += w * (seconds / tokens - s.alone)
                s.alone_steps += 1

    def observe(
        self,
        drafted: DraftedTree,
        tokens: list[int],
        draft_seconds: float,
        target_seconds: float,
        regime: str = GREEDY,
        request: RegimeStats | None = None,
        pass_sessions: int = 1,
        pass_tokens: int = 0,
    ) -> None:
        """Learn from one step whose `tokens` (accepted path and the target's own token) were not cut
        short by a stop or a length limit, into the regime's means and `request`'s. A request's first
        step is not one to learn from: both models' pass over the prompt is in its times. A step that
        proposed nothing still counts towards the rate: were it left out, a rate learned on easier
        text would hold the floors up and keep the trees empty. `pass_sessions` and `pass_tokens`
        describe the target pass the tree shared with other sessions' (0 tokens: not reported): its
        nodes made that pass longer by what the curve says they cost it, for each of the others and
        each token they committed in it, taken to be as many as this step's."""
        tree, forwards = drafted.tree, drafted.draft_forwards
        n = tree.size - 1
        shape = None
        if n >= 1 and tree.logprobs is not None:
            expanded = np.unique(tree.parents[1:]).size - 1  # nodes with children, the root aside
            shape = StepShape(
                accepted=len(tokens) - 1,
                predicted=float(np.exp(tree.logprobs[1:].astype(np.float64)).sum()),
                size=n,
                batch=expanded / forwards if forwards and expanded and not drafted.reused else None,
                children=n / (1 + expanded),
                reused=drafted.reused,
            )
        with self._lock:
            if shape is not None and shape.reused:
                batch = max(self._request(regime, request)[0].batch, 1.0)
                fresh = self.draft_scale * (interpolate(self.draft_curve, 1)
                                            + expanded / batch * interpolate(self.draft_curve, batch))  # fmt: skip
                shape = replace(shape, hidden=min(max(1.0 - draft_seconds / fresh, 0.0), 1.0))
            imposed = 0.0
            if pass_sessions > 1 and pass_tokens > n >= 1:
                longer = interpolate(self.target_curve, pass_tokens) - interpolate(self.target_curve, pass_tokens - n)
                imposed = (pass_sessions - 1) * len(tokens) * self.target_scale * max(longer, 0.0)
            for s in _both(*self._request(regime, request)):
                s.learn(len(tokens), draft_seconds + target_seconds, shape, imposed)
            self._learn_sharing(pass_sessions)
            if shape is None:
                return
            if not shape.reused:  # a re-rooted tree's draft time is only what the search had left to do
                batch = shape.batch if shape.batch is not None else 1.0
                modelled = interpolate(self.draft_curve, 1) + forwards * interpolate(self.draft_curve, batch)
                self.draft_scale *= _ema_ratio(draft_seconds, self.draft_scale * modelled)
            modelled = interpolate(self.target_curve, pass_tokens or n + 1)
            self.target_scale *= _ema_ratio(target_seconds, self.target_scale * modelled)


def _key(regime: str, load: int) -> str:
    return regime if load == 1 else f"{regime}@{load}"


def _both(shared: RegimeStats, own: RegimeStats) -> tuple[RegimeStats, ...]:
    return (shared,) if own is shared else (shared, own)


def free_batch(draft_curve: list[tuple[int, float]], slack: float = 1.25) -> int:
    """The largest expansion batch the draft runs in about the time of one token: expanding more nodes
    per forward is then free, and fewer forwards build the same tree."""
    one = interpolate(draft_curve, 1)
    return max((n for n, t in draft_curve if t <= slack * one), default=1)


def _plain(value: float | int | bool) -> float | int | bool:
    """A running mean as JSON takes it: numpy's scalars are not all Python numbers."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    return int(value) if isinstance(value, int | np.integer) else float(value)


def _ema_ratio(observed: float, predicted: float) -> float:
    """Multiplier moving a scale SCALE_EMA of the way towards observed / predicted."""
    if predicted <= 0 or observed <= 0:
        return 1.0
    return 1.0 + SCALE_EMA * (observed / predicted - 1.0)
