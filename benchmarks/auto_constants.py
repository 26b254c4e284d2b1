"""`--budget auto` with different planner constants against fixed node-floored shapes, on the real pair.

The constants of `client/budget.py` were first fitted in `benchmarks/planner_sim.py`; this checks them
on the real models. It runs the bench's own loop (`client.bench.harness.run_phase`: the bench's balanced
first N prompts, contestants taking turns in a rotating order), which `specexec bench` cannot do
here because its auto contestant has one planner with the module's constants. Writes every run to
`--out` and prints median tok/s and draft nodes a step per category, the bench's ranking, and each
auto variant against every other contestant, paired run by run.

    .venv/bin/python -m benchmarks.auto_constants --limit 12 --constants 1.25,3 1.25,1 --out runs.json
    .venv/bin/python -m benchmarks.auto_constants --categories code prose --limit 16 --repeat 2 \
        --constants 1.25,1 1.25,0.5 --budgets 8 16 --out runs.json
    .venv/bin/python -m benchmarks.auto_constants --categories code prose --limit 16 \
        --constants 1.25,1 --shared --budgets 8 16 --out runs.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from client.api import SpecExec
from client.bench.harness import SETTINGS, engine_contestant, load_prompts, profiled_default_pair, run_phase
from client.bench.stats import rank, summarize, versus
from client.budget import BudgetPlanner
from common.decoding.tree import TreeParams


class SharedPlanner(BudgetPlanner):
    """Requests keep no means of their own: each plans with, and teaches, its regime's shared ones."""

    def start(self, regime: str) -> None:  # type: ignore[override]
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--constants", nargs="+", default=["1.25,3", "1.25,1"], help="K_LEVEL,K_NODE pairs")
    ap.add_argument("--categories", nargs="+", help="only these prompt categories")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the prompt set")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16], help="fixed shapes, p=0.6 q=0.05")
    ap.add_argument("--shared", action="store_true",
                    help="also race the first constants' planner with no per-request means: every "
                    "request plans with its regime's shared means, as auto did before 24 November 2026 "
                    "(but with the fast start a new planner now has)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, draft, tokenizer = profiled_default_pair()
    base = TreeParams(budget=max(args.budgets))
    contestants = [
        engine_contestant("autoregressive", SpecExec(target, None, tokenizer, mode="autoregressive"))
    ]
    for constants in args.constants:
        gen = SpecExec(target, draft, tokenizer, tree=base, auto_budget=True)
        assert gen.planner is not None
        gen.planner.k_level, gen.planner.k_node = (float(x) for x in constants.split(","))
        contestants.append(engine_contestant(f"auto {gen.planner.k_level:g}/{gen.planner.k_node:g}", gen))
    if args.shared:
        gen = SpecExec(target, draft, tokenizer, tree=base, auto_budget=True)
        assert gen.planner is not None
        k_level, k_node = (float(x) for x in args.constants[0].split(","))
        gen.planner = SharedPlanner(gen.planner.target_curve, gen.planner.draft_curve, base=base,
                                    k_level=k_level, k_node=k_node)  # fmt: skip
        contestants.append(engine_contestant(f"auto {k_level:g}/{k_node:g} shared", gen))
    for b in args.budgets:
        shape = replace(base, budget=b, min_prob=0.6, min_node_prob=0.05)
        contestants.append(
            engine_contestant(f"b={b} p=0.6 q=0.05", SpecExec(target, draft, tokenizer, tree=shape))
        )
    prompts = load_prompts(None, args.limit, args.categories)
    runs = run_phase(prompts, contestants, tokenizer, SETTINGS,
                     args.max_new_tokens, 0, "auto constants", args.repeat)  # fmt: skip
    args.out.write_text(json.dumps([r.__dict__ for r in runs]))
    for row in summarize(runs, contestants):
        nodes = row["mean_draft_nodes"] or 0.0
        print(f"{row['setting']:7s} {row['category']:5s} {row['contestant']:18s} "
              f"{row['tok_s_median']:6.2f} tok/s {nodes:4.1f} nodes")  # fmt: skip
    print("\nplaces (x the target alone: median of per-prompt ratios; beat: runs won against the next)")
    for row in rank(runs):
        ratio = row["x_target_alone"] or 0.0
        print(f"{row['setting']:7s} {row['category']:5s} {row['place']:2d} {row['contestant']:18s} "
              f"{row['tok_s_median']:6.2f} tok/s {ratio:5.2f}x beat {row['beat_next']}/{row['paired_runs']}")  # fmt: skip
    print("\neach auto variant against the others (geometric mean of per-run speed ratios; runs won)")
    autos = [c.name for c in contestants if c.name.startswith("auto")]
    for mine in autos:
        for theirs in [c.name for c in contestants[1:] if c.name != mine]:
            for row in versus(runs, mine, theirs):
                print(f"{row['setting']:7s} {row['category']:5s} {mine} / {theirs}: {row['ratio']:.3f} "
                      f"won {row['wins']}/{row['paired_runs']}")  # fmt: skip


if __name__ == "__main__":
    main()
