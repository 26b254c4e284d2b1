"""`--budget auto` against fixed shapes in a synthetic world: minutes of planner evaluation in seconds.

The bench's real runs take 20-60 minutes and this machine's speed drifts by more than the margins
between shapes. Here every contestant decodes the same token streams with the same forward-time
curves, so a change to the planner (`client/budget.py`) can be judged before a real run.

The world:
- the target's reply is fixed per request, position by position, as in greedy decoding. At each
  position the draft has a confidence c: its top token gets probability c and the rest share
  1 - c. The target takes the draft's top token with probability c, its second with that token's
  probability, and otherwise one the draft ranks lower (a calibrated draft). c is drawn around a
  mean that changes every 32 tokens: 0.75-0.95 on code, 0.4-0.7 on prose. The reply's first token
  is never guessed: the bench's code prompts accept nothing on their opening step.
- trees are grown by the real `TreeBuilder`. Nodes off the target's path get random confidences.
  The draft's expansion batches are timed on its forward-time curve and the tree on the target's
  (`docs/forward.json`, this CPU), each with up to 10% noise. Its catch-up pass runs the target's
  token, and the last accepted node where the draft never expanded it (the draft keeps the KV of
  the nodes it expanded).
- requests alternate code and prose, as a gateway's traffic might; auto's planner carries over.

    .venv/bin/python -m benchmarks.planner_sim              # the table
    .venv/bin/python -m benchmarks.planner_sim --seeds 1 --requests 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from client.budget import GREEDY, BudgetPlanner
from common.decoding.tree import DraftedTree, TreeParams
from common.model.profiling import interpolate, profile_sizes
from draft_node.tree_builder import TreeBuilder

ROOT = Path(__file__).resolve().parents[1]  # the repository: docs/forward.json
VOCAB = 8
MISS = VOCAB  # a token the draft never proposes
SHARES = torch.tensor([0.5, 0.2, 0.1, 0.08, 0.05, 0.04, 0.03])  # how the draft splits 1 - confidence
SEGMENT = 32
CATEGORIES = {"code": (0.75, 0.95), "prose": (0.40, 0.70)}  # range of a segment's mean confidence
SPREAD = 4.0  # Beta concentration of per-position confidence around its segment's mean
BASE = TreeParams(budget=16, max_depth=16, max_branch=8, expand_batch=16)


def distribution(confidence: float) -> torch.Tensor:
    return torch.cat((torch.tensor([confidence]), (1 - confidence) * SHARES)).log()


@dataclass
class Reply:
    """The target's text, and the draft's confidence at each position of it."""

    tokens: list[int]
    confidence: list[float]


def reply(rng: random.Random, category: str, length: int) -> Reply:
    """A calibrated draft: the target takes the draft's top token with the draft's confidence, its
    second with the second's probability, and otherwise a token outside the draft's top 2."""
    low, high = CATEGORIES[category]
    tokens, confidence = [MISS], [0.3]
    while len(tokens) < length:
        mean = rng.uniform(low, high)
        for _ in range(SEGMENT):
            c = rng.betavariate(mean * SPREAD, (1 - mean) * SPREAD)
            r = rng.random()
            tokens.append(0 if r < c else 1 if r < c + (1 - c) * SHARES[0] else MISS)
            confidence.append(c)
    return Reply(tokens[:length], confidence[:length])


class TimedExpander:
    """The draft's children of every node, with the time its forwards would take. A node on the
    target's path gets the text's confidence at its position; any other node a random one."""

    def __init__(
        self, text: Reply, at: int, curve: list[tuple[int, float]], rng: random.Random, mean: float
    ) -> None:
        self.text, self.at, self.curve, self.rng, self.mean = text, at, curve, rng, mean
        self.on_path = {0: True}  # working id -> whether its tokens spell the target's text
        self.depth = {0: 0}
        self.seconds = 0.0

    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor, parents: Tensor) -> Tensor:
        self.seconds += interpolate(self.curve, nodes.numel()) * (1 + 0.1 * self.rng.random())
        rows = []
        for node, token, depth, parent in zip(
            nodes.tolist(), tokens.tolist(), depths.tolist(), parents.tolist(), strict=True
        ):
            position = self.at + depth
            on_path = self.on_path[parent] and position - 1 < len(self.text.tokens)
            on_path = on_path and self.text.tokens[position - 1] == token
            self.on_path[node], self.depth[node] = on_path, depth
            if on_path and position < len(self.text.confidence):
                c = self.text.confidence[position]
            else:
                c = self.rng.betavariate(self.mean * SPREAD, (1 - self.mean) * SPREAD)
            rows.append(distribution(c))
        return torch.stack(rows)

    def move(self, src: Tensor, dst: Tensor) -> None:
        for a, b in zip((src + 1).tolist(), (dst + 1).tolist(), strict=True):
            self.on_path[b], self.depth[b] = self.on_path.pop(a), self.depth.pop(a)

    def drop(self, slots: Tensor) -> None:
        """What a pruned node was is never asked again."""


Curves = tuple[list[tuple[int, float]], list[tuple[int, float]]]  # target's, draft's: (tokens, seconds)


@dataclass
class Tally:
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0


def decode(
    text: Reply,
    shape: TreeParams | None,
    planner: BudgetPlanner | None,
    curves: Curves,
    noise: random.Random,
) -> Tally:
    """One request, as `client.generation.Sequence.steps` runs it, with modelled times."""
    target_curve, draft_curve = curves
    tally, pending = Tally(), 1
    request = planner.start(GREEDY) if planner is not None else None
    while tally.tokens < len(text.tokens):
        opening = tally.tokens == 0
        params = planner.choose(GREEDY, request) if planner is not None else shape
        assert params is not None
        at = tally.tokens
        expander = TimedExpander(text, at, draft_curve, noise, statistics.mean(text.confidence))
        catch_up = interpolate(draft_curve, pending) * (1 + 0.1 * noise.random())
        built = TreeBuilder(params).build(MISS, distribution(text.confidence[at]), expander)
        tree = built.tree
        rest = text.tokens[at:]
        path = tree.walk(rest)
        accepted = len(path) - 1
        # The draft keeps the KV of the accepted nodes it expanded; the rest and the target's token wait.
        pending = 1 + int(not built.expanded[path[-1]])
        returned = rest[: accepted + 1]
        draft_s = catch_up + expander.seconds
        target_s = interpolate(target_curve, tree.size) * (1 + 0.1 * noise.random())
        if planner is not None and not opening:
            planner.observe(
                DraftedTree(tree, built.draft_forwards), returned, draft_s, target_s, GREEDY, request
            )
        tally.tokens += len(returned)
        tally.steps += 1
        tally.seconds += draft_s + target_s
    return tally


def curves(path: Path, target: str, draft: str) -> Curves:
    rows = {(r["model"], r["config"]): r for r in json.loads(path.read_text())["rows"]}

    def curve(model: str, config: str) -> list[tuple[int, float]]:
        """Resampled at the sizes the nodes profile at start-up, as the planner sees them."""
        row = rows[(model, config)]
        measured = sorted((int(k[2:]), v / 1000) for k, v in row.items() if k.startswith("k="))
        return [(n, interpolate(measured, n)) for n in profile_sizes(measured[-1][0])]

    return curve("qwen2.5-coder-1.5b", target), curve("qwen2.5-coder-0.5b", draft)


CONTESTANTS: dict[str, TreeParams | None] = {
    "auto": None,
    **{f"b={b}": TreeParams(b, 16, 8, 16) for b in (4, 8, 16)},
    **{f"chain k={k}": TreeParams.chain(k) for k in (2, 4, 8)},
    **{f"b={b} p=0.6": TreeParams(b, 16, 8, 16, min_prob=0.6) for b in (4, 8)},
    "chain k=8 p=0.6": TreeParams.chain(8, min_prob=0.6),
    "b=16 p=0.6 q=0.05": TreeParams(16, 16, 8, 16, min_prob=0.6, min_node_prob=0.05),
}


def simulate(
    seeds: int, requests: int, new_tokens: int, timing: Curves
) -> dict[tuple[str, str], list[Tally]]:
    """Each seed: one set of replies, decoded by every contestant (auto with a fresh planner)."""
    results: dict[tuple[str, str], list[Tally]] = {}
    for seed in range(seeds):
        rng = random.Random(seed)
        texts = [(cat, reply(rng, cat, new_tokens)) for _ in range(requests) for cat in CATEGORIES]
        for name, shape in CONTESTANTS.items():
            planner = BudgetPlanner(*timing, base=BASE) if shape is None else None
            noise = random.Random(seed)
            for cat, text in texts:
                results.setdefault((name, cat), []).append(decode(text, shape, planner, timing, noise))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=6, help="independent runs, each a fresh planner")
    ap.add_argument("--requests", type=int, default=4, help="requests per category in each run")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--forward", type=Path, default=ROOT / "docs/forward.json")
    ap.add_argument("--target-config", default="repacked")
    ap.add_argument("--draft-config", default="int8")
    args = ap.parse_args()
    timing = curves(args.forward, args.target_config, args.draft_config)
    results = simulate(args.seeds, args.requests, args.new_tokens, timing)
    print(f"| contestant | {' | '.join(f'{c} tok/s | {c} tok/pass' for c in CATEGORIES)} |")
    print("|---|" + "---|---|" * len(CATEGORIES))
    for name in CONTESTANTS:
        cells = []
        for cat in CATEGORIES:
            runs = results[(name, cat)]
            speed = statistics.mean(t.tokens / t.seconds for t in runs)
            per_pass = sum(t.tokens for t in runs) / sum(t.steps for t in runs)
            cells += [f"{speed:.2f}", f"{per_pass:.2f}"]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
