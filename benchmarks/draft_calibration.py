"""Is the draft calibrated for the target? How often the target takes a proposed child, against the
probability the draft gave it, on the real pair.

The auto planner (`client/budget.py`) prices a tree node at c·q: the draft's cumulative probability
times one running calibration. That is right only if a child the draft gives probability p (given
its parent) is taken about p of the time, at every p. Here every step of a fixed, unfloored tree
(so that unlikely children are proposed too) is recorded; each child of a node on the accepted path
was a fair trial (its parent was accepted), and it succeeded if the target took it. Children are
binned by p, and counted by rank among their siblings.

    .venv/bin/python -m benchmarks.draft_calibration --limit 9 --budget 16
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np
import torch

from client.bench.harness import SETTINGS, encode, load_prompts, profiled_default_pair
from client.generation import GenerationStats, Sequence
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams

EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
RANKS = 4


class RecordingDraft:
    """The draft engine, keeping the last tree it built."""

    def __init__(self, inner: object) -> None:
        self.inner, self.last = inner, None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def build_tree(self, *args: object, **kwargs: object) -> DraftedTree:
        self.last = self.inner.build_tree(*args, **kwargs)  # type: ignore[attr-defined]
        return self.last


def trials(tree: TokenTree, path: list[int]) -> list[tuple[float, int, bool]]:
    """(p given the parent, rank among siblings, taken) for every child of an accepted node."""
    assert tree.logprobs is not None
    on_path, rows = set(path), []
    for node in path:
        children = np.flatnonzero(tree.parents == node)
        if children.size == 0:
            continue
        lp = tree.logprobs[children] - tree.logprobs[node]
        order = np.argsort(-lp, kind="stable")
        for rank, i in enumerate(order.tolist()):
            rows.append((float(np.exp(lp[i])), rank, int(children[i]) in on_path))
    return rows


def table(rows: list[tuple[float, int, bool]]) -> list[str]:
    bins: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    ranks: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for p, rank, taken in rows:
        b = next(j for j in range(len(EDGES) - 1) if p < EDGES[j + 1] or j == len(EDGES) - 2)
        bins[b][0] += 1
        bins[b][1] += p
        bins[b][2] += taken
        ranks[min(rank, RANKS - 1)][0] += 1
        ranks[min(rank, RANKS - 1)][1] += taken
    lines = ["| draft p | children | mean p | taken |", "|---|---|---|---|"]
    for b in sorted(bins):
        n, total, taken = bins[b]
        lines.append(f"| {EDGES[b]:.2f}–{EDGES[b + 1]:.2f} | {n:.0f} | {total / n:.3f} | {taken / n:.3f} |")
    taken_by_rank = ", ".join(
        f"{'≥' if r == RANKS - 1 else ''}{r + 1}: {t / n:.2f} of {n}" for r, (n, t) in sorted(ranks.items())
    )
    return [*lines, f"\ntaken by rank among siblings: {taken_by_rank}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=9)
    ap.add_argument("--categories", nargs="+", help="only these prompt categories")
    ap.add_argument("--budget", type=int, default=16, help="the fixed tree's size (no floors)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, draft, tokenizer = profiled_default_pair(max_tree=args.budget)
    recorder = RecordingDraft(draft)
    shape = TreeParams(budget=args.budget)
    rows: dict[tuple[str, str], list[tuple[float, int, bool]]] = defaultdict(list)
    for setting, extra in SETTINGS.items():
        for i, prompt in enumerate(load_prompts(None, args.limit, args.categories)):
            sequence = Sequence(target, recorder, encode(tokenizer, prompt["prompt"]))  # type: ignore[arg-type]
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=i, **extra)
            try:
                for result in sequence.steps(sampling, shape, GenerationStats()):
                    if result.finish_reason:  # cut short by the length limit: not a fair trial
                        continue
                    assert recorder.last is not None
                    tree = recorder.last.tree
                    found = trials(tree, tree.walk(result.tokens))
                    rows[(setting, prompt["category"])] += found
                    rows[(setting, "all")] += found
            finally:
                sequence.close()
            print(f"{setting} {prompt['category']} prompt {i} done", file=sys.stderr, flush=True)
    for (setting, category), found in sorted(rows.items()):
        print(f"\n### {setting}, {category}\n")
        print("\n".join(table(found)))


if __name__ == "__main__":
    main()
