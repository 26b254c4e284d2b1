"""`--budget auto`: pick the tree size that maximises expected tokens per second on this hardware.

Per step, E[tokens](B) = 1 + c * S(B), where S(B) is the summed draft probability of the B most
probable tree nodes (the expected accepted length if the target agreed with the draft, SpecExec's
own criterion) and c is a running calibration of observed over predicted acceptance. The step time
is the draft's tree-building time plus one target pass over B + 1 tokens, both read off the
forward-time curves the nodes measured at start-up. Large trees win where a target pass costs the
same for 1 and 1000 tokens (an offloaded GPU), small ones on a CPU.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace

import torch

from common.profiling import interpolate
from common.tree import TokenTree, TreeParams, TreeStructure

EMA = 0.2
EXPLORE_EVERY = 8


@dataclass
class BudgetPlanner:
    target_curve: list[tuple[int, float]]
    draft_curve: list[tuple[int, float]]
    base: TreeParams  # its budget is the largest considered
    calibration: float = 1.0
    draft_scale: float = 1.0  # observed / modelled draft time (Python overhead, network, contention)
    target_scale: float = 1.0
    survival: torch.Tensor | None = None  # S(B) for B = 0..len-1
    depth: torch.Tensor | None = None  # deepest node among the top B, for B = 0..len-1
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # one planner serves every request of a gateway
        if not self.target_curve or not self.draft_curve:
            raise ValueError(
                "--budget auto needs forward-time curves from both nodes (start them with profiling on)"
            )
        self.expand_batch = free_batch(self.draft_curve)
        self.probe = self._probe_budget()

    def candidates(self, limit: int) -> list[int]:
        sizes, b = [], 1
        while b < limit:
            sizes.append(b)
            b *= 2
        return [*sizes, limit]

    def _probe_budget(self) -> int:
        """The first tree is built large enough to learn S(B), but no larger than 4 cheap steps cost."""
        one = self.step_seconds(1, 1)
        fits = [
            b
            for b in self.candidates(self.base.budget)
            if self.step_seconds(b, min(b, self.base.max_depth)) <= 4 * one
        ]
        return max(fits, default=1)

    def draft_seconds(self, budget: int, depth: int) -> float:
        """One pass to catch up on the tokens the last step accepted, whatever the tree's size; then
        one forward per level of the tree, each expanding at most expand_batch nodes.

        The fixed catch-up pass must be modelled as fixed: folded into `draft_scale`, it would make
        every tree look as much dearer as the small trees the planner has been choosing, and the
        planner would keep choosing them."""
        batch = min(self.expand_batch, budget)
        iterations = max(depth, math.ceil(budget / self.expand_batch))
        passes = interpolate(self.draft_curve, 1) + iterations * interpolate(self.draft_curve, batch)
        return self.draft_scale * passes

    def target_seconds(self, budget: int) -> float:
        return self.target_scale * interpolate(self.target_curve, budget + 1)

    def step_seconds(self, budget: int, depth: int) -> float:
        return self.draft_seconds(budget, depth) + self.target_seconds(budget)

    def expected_tokens(self, budget: int) -> float:
        """1 + c * S(B), never more than the deepest path among the top B nodes can give."""
        assert self.survival is not None and self.depth is not None
        b = min(budget, len(self.survival) - 1)
        return 1.0 + min(self.calibration * float(self.survival[b]), float(self.depth[b]))

    def table(self) -> list[dict[str, float]]:
        assert self.survival is not None and self.depth is not None
        rows = []
        for b in self.candidates(len(self.survival) - 1):
            depth = int(self.depth[b])
            seconds = self.step_seconds(b, depth)
            tokens = self.expected_tokens(b)
            rows.append(
                dict(
                    budget=b,
                    draft_s=self.draft_seconds(b, depth),
                    target_s=self.target_seconds(b),
                    expected_tokens=tokens,
                    tokens_per_s=tokens / seconds,
                )
            )
        return rows

    def choose(self) -> TreeParams:
        """The best budget by the model; every EXPLORE_EVERY steps twice that, so the planner keeps
        learning S(B) beyond the sizes it has been choosing."""
        with self._lock:
            return self._choose()

    def _choose(self) -> TreeParams:
        if self.survival is None:
            return replace(self.base, budget=self.probe, expand_batch=self.expand_batch)
        best = int(max(self.table(), key=lambda r: r["tokens_per_s"])["budget"])
        if len(self.history) % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            best = min(2 * best, self.base.budget)
        return replace(self.base, budget=best, expand_batch=self.expand_batch)

    def observe(self, tree: TokenTree, accepted: int, draft_seconds: float, target_seconds: float) -> None:
        with self._lock:
            self._observe(tree, accepted, draft_seconds, target_seconds)

    def _observe(self, tree: TokenTree, accepted: int, draft_seconds: float, target_seconds: float) -> None:
        n = tree.size - 1
        if tree.logprobs is None or n < 1:
            return
        depth_n = int(TreeStructure.from_parents(tree.parents).depths.max())
        self.draft_scale *= _ema_ratio(draft_seconds, self.draft_seconds(n, depth_n))
        self.target_scale *= _ema_ratio(target_seconds, self.target_seconds(n))
        order = torch.argsort(tree.logprobs[1:], descending=True, stable=True) + 1
        survival = torch.cat((torch.zeros(1), tree.logprobs[order].double().exp().cumsum(0).float()))
        depths = TreeStructure.from_parents(tree.parents).depths[order]
        depth = torch.cat((torch.zeros(1, dtype=torch.long), depths.cummax(0).values))
        predicted = float(survival[-1])
        if predicted > 0:
            self.calibration += EMA * (accepted / predicted - self.calibration)
        if self.survival is not None and len(self.survival) > len(survival):
            # Keep the tail learned from a larger tree, re-anchored at this tree's size.
            tail = self.survival[len(survival) :] - self.survival[n] + survival[-1]
            survival = torch.cat((survival, tail))
            depth = torch.cat((depth, torch.maximum(self.depth[len(depth) :], depth[-1])))
        self.survival, self.depth = survival, depth
        self.history.append(n)


def free_batch(draft_curve: list[tuple[int, float]], slack: float = 1.25) -> int:
    """The largest expansion batch the draft runs in about the time of one token: expanding more nodes
    per forward is then free, and fewer forwards build the same tree."""
    one = interpolate(draft_curve, 1)
    return max((n for n, t in draft_curve if t <= slack * one), default=1)


def _ema_ratio(observed: float, predicted: float) -> float:
    """Multiplier moving a scale EMA of the way towards observed / predicted."""
    if predicted <= 0 or observed <= 0:
        return 1.0
    return 1.0 + EMA * (observed / predicted - 1.0)
