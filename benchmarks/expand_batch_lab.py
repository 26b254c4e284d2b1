"""The draft's expansion batch under `--budget auto`, in the home lab (nodes pinned apart): the
planner's choice (`client.budget.free_batch`) against fixed batches, all on the pipelined split,
taking turns prompt by prompt, greedy. Prints tok/s per category and each batch's speed over the
planner's choice (geometric mean of per-prompt ratios), with the share of the wall time spent
waiting for the draft and the nodes drafted per step.

    .venv/bin/python -m benchmarks.expand_batch_lab --batches 4 8 16 --limit 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from tqdm import tqdm

from client.bench.harness import encode, load_prompts
from client.bench.home_lab import HomeLabConfig, Lab
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-quantize", default="int8")
    parser.add_argument("--categories", nargs="+", default=["code", "prose"])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-budget", type=int, default=64)
    args = parser.parse_args()
    config = HomeLabConfig(dtype=args.dtype, draft_quantize=args.draft_quantize, categories=tuple(args.categories),
                           limit=args.limit, max_new_tokens=args.max_new_tokens, max_budget=args.max_budget)  # fmt: skip
    os.sched_setaffinity(0, set(config.draft_cores))
    torch.set_num_threads(1)
    lab = Lab(config)
    try:
        tree = TreeParams(budget=config.max_budget)
        gens = {}
        for batch in [None, *args.batches]:
            gen = connect(lab.addrs["draft-pipe"], lab.target, tree=tree, auto_budget=True)
            assert gen.planner is not None
            chosen = gen.planner.expand_batch
            if batch is not None:
                gen.planner.expand_batch = batch
            gens[f"batch {batch}" if batch else f"planner's ({chosen})"] = gen
        prompts = load_prompts(None, config.limit, config.categories)
        runs = []
        with tqdm(total=len(prompts) * len(gens), desc="expand batch", unit="run") as bar:
            for i, p in enumerate(prompts):
                ids = encode(gens[next(iter(gens))].tokenizer, p["prompt"])
                for gen in gens.values():
                    gen.generate(ids, SamplingParams(max_new_tokens=4))
                for name, gen in gens.items():
                    time.sleep(1.0)  # the last run's lookahead settles
                    out = gen.generate(ids, SamplingParams(max_new_tokens=config.max_new_tokens, ignore_eos=True))
                    runs.append((name, i, p["category"], out.stats))
                    bar.update()
    finally:
        lab.close()
    base = next(iter(gens))
    print("| category | expansion batch | tok/s | x planner's | draft wait | nodes/step | tokens/pass |\n|---|---|---|---|---|---|---|")
    for category in args.categories:
        ref = {i: s.tokens_per_second for n, i, c, s in runs if n == base and c == category}
        for name in gens:
            mine = [(i, s) for n, i, c, s in runs if n == name and c == category]
            ratio = statistics.geometric_mean(s.tokens_per_second / ref[i] for i, s in mine)
            steps = max(sum(s.target_steps for _, s in mine), 1)
            wait = sum(s.draft_seconds for _, s in mine) / sum(s.wall_seconds for _, s in mine)
            nodes = sum(sum(s.budgets) for _, s in mine) / steps
            tokens = sum(s.new_tokens for _, s in mine) / steps
            rate = statistics.mean(s.tokens_per_second for _, s in mine)
            print(f"| {category} | {name} | {rate:.2f} | {ratio:.2f} | {wait:.0%} | {nodes:.1f} | {tokens:.2f} |")


if __name__ == "__main__":
    main()
