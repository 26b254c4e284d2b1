"""The target's LM head in one call per tree against one call for the inner nodes plus one for the leaf
a walk ends on, interleaved on the real pair.

`target_node.session.ALL_LOGITS_MAX_NODES` decides which trees get every node's logits in one call;
each contestant sets it before its run (0: the former inner-nodes-only call), so both variants take
turns on the same prompts in the bench's rotating order (`client.bench.harness.run_phase`). Prints median
tok/s per category and each new variant against its former self, paired run by run.

    .venv/bin/python scripts/logits_ab.py --categories code prose --limit 16 --out runs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import target_node.session as target_session
from client.api import SpecExec
from client.bench.harness import (
    SETTINGS,
    Contestant,
    Run,
    engine_contestant,
    load_prompts,
    profiled_default_pair,
    run_phase,
)
from client.bench.stats import summarize, versus
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams


def with_logits_cap(contestant: Contestant, cap: int) -> Contestant:
    def run(ids: list[int], sampling: SamplingParams) -> Run:
        target_session.ALL_LOGITS_MAX_NODES = cap
        return contestant.run(ids, sampling)

    return Contestant(contestant.name, contestant.family, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--categories", nargs="+", help="only these prompt categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cap = target_session.ALL_LOGITS_MAX_NODES
    target, draft, tokenizer = profiled_default_pair()
    shapes = {"b=8 p=0.6 q=0.05": TreeParams(budget=8, min_prob=0.6, min_node_prob=0.05), "auto": None}
    contestants = []
    for name, shape in shapes.items():
        for variant, logits_cap in (("one call", cap), ("leaf apart", 0)):
            gen = SpecExec(
                target, draft, tokenizer, tree=shape or TreeParams(budget=16), auto_budget=shape is None
            )
            contestants.append(with_logits_cap(engine_contestant(f"{name}, {variant}", gen), logits_cap))
    prompts = load_prompts(None, args.limit, args.categories)
    runs = run_phase(prompts, contestants, tokenizer, SETTINGS,
                     args.max_new_tokens, 0, "logits a/b")  # fmt: skip
    target_session.ALL_LOGITS_MAX_NODES = cap
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
