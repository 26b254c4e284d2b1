"""The target's LM head in one call per tree against one call for the inner nodes plus one for the leaf
a walk ends on, interleaved on the real pair.

A target engine's `all_logits_max_nodes` (default `target_node.torch_session.ALL_LOGITS_MAX_NODES`) decides
which trees get every node's logits in one call; the leaf-apart variant runs a second engine over the
same loaded model with the cap at 0 (the former inner-nodes-only call), so both variants take turns
on the same prompts in the bench's rotating order (`client.bench.harness.run_phase`). Prints median
tok/s per category and each new variant against its former self, paired run by run.

    .venv/bin/python -m benchmarks.logits_ab --categories code prose --limit 16 --out runs.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from client.api import SpecExec
from client.bench.harness import SETTINGS, engine_contestant, load_prompts, profiled_default_pair, run_phase
from client.bench.stats import summarize, versus
from common.decoding.tree import TreeParams
from target_node.engine import TargetEngine


def leaf_apart(target: TargetEngine) -> TargetEngine:
    """`target`'s model and forward-time curve, with every tree's leaves' logits computed apart."""
    twin = TargetEngine(
        target.loaded, all_logits_max_nodes=0, max_context=target.max_context, max_tree=target.max_tree
    )
    twin.forward_curve = target.forward_curve
    return twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--categories", nargs="+", help="only these prompt categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, draft, tokenizer = profiled_default_pair()
    targets = {"one call": target, "leaf apart": leaf_apart(target)}
    shapes = {"b=8 p=0.6 q=0.05": TreeParams(budget=8, min_prob=0.6, min_node_prob=0.05), "auto": None}
    contestants = []
    for name, shape in shapes.items():
        for variant, engine in targets.items():
            gen = SpecExec(
                engine, draft, tokenizer, tree=shape or TreeParams(budget=16), auto_budget=shape is None
            )
            contestants.append(engine_contestant(f"{name}, {variant}", gen))
    prompts = load_prompts(None, args.limit, args.categories)
    runs = run_phase(prompts, contestants, tokenizer, SETTINGS,
                     args.max_new_tokens, 0, "logits a/b")  # fmt: skip
    args.out.write_text(json.dumps([r.__dict__ for r in runs]))
    for row in summarize(runs, contestants):
        print(
            f"{row['setting']:7s} {row['category']:5s} {row['contestant']:28s} {row['tok_s_median']:6.2f} tok/s"
        )
    print("\none call against the leaf apart (geometric mean of per-run speed ratios; runs won)")
    for name in shapes:
        for row in versus(runs, f"{name}, one call", f"{name}, leaf apart"):
            print(
                f"{row['setting']:7s} {row['category']:5s} {name}: {row['ratio']:.3f} won {row['wins']}/{row['paired_runs']}"
            )


if __name__ == "__main__":
    main()
