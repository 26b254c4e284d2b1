"""Runs on the target alone in the home lab: each split and the target alone with and without them.
The quickstart's pair as `specexec bench --home-lab --lab-backend llama.cpp --lab-draft-backend torch`
runs it (draft node on core 0, target node on core 1, one thread each, `--budget auto`), the
contestants interleaved prompt by prompt in alternating order, each with a planner of its own; "a
call per token" clients send every step as a Verify (`RemoteTarget.runs_apart` off), as before Decode.

    python -m benchmarks.runs_lab [--limit 8] [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from tqdm import tqdm

from client.bench.harness import encode, load_prompts
from client.bench.home_lab import HomeLabConfig, Lab
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.ops.hugepages import reexec_with_huge_pages

PAIRS = ("target alone", "split, sequential", "split, pipelined")
ITSELF = "llama.cpp itself"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    config = HomeLabConfig(dtype="float32", backend="llama.cpp", draft_backend="torch", limit=args.limit,
                           categories=("code", "prose"), max_new_tokens=args.tokens)  # fmt: skip
    os.sched_setaffinity(0, set(config.draft_cores))
    torch.set_num_threads(1)
    lab = Lab(config)
    rows: list[dict[str, object]] = []
    try:
        tree, t = TreeParams(budget=config.max_budget), lab.target
        gens = {}
        for runs in (True, False):
            suffix = "" if runs else ", a call per token"
            made = {
                "target alone": connect(None, t, mode="autoregressive"),
                "split, sequential": connect(lab.addrs["draft-seq"], t, tree=tree, auto_budget=True),
                "split, pipelined": connect(lab.addrs["draft-pipe"], t, tree=tree, auto_budget=True),
            }
            for name, gen in made.items():
                gen.target.runs_apart = runs  # type: ignore[attr-defined]
                gens[name + suffix] = gen
        names = [*gens, ITSELF]
        tokenizer = gens["target alone"].tokenizer
        prompts = load_prompts(None, config.limit, config.categories)
        for gen in gens.values():  # untimed: a first request pays for connecting and opening
            gen.generate(encode(tokenizer, prompts[0]["prompt"]), SamplingParams(max_new_tokens=8, ignore_eos=True))
        with tqdm(total=args.rounds * len(prompts) * len(names), desc="runs lab", unit="run") as bar:
            for i, p in [(i, p) for _ in range(args.rounds) for i, p in enumerate(prompts)]:
                ids = encode(tokenizer, p["prompt"])
                row: dict[str, object] = {"category": p["category"]}
                for name in names[:: -1 if (i + len(rows) // len(prompts)) % 2 else 1]:
                    time.sleep(1.0)
                    if name == ITSELF:
                        assert lab.itself is not None
                        tokens, wall = lab.itself(ids, args.tokens)
                        row[name] = len(tokens) / wall
                    else:
                        out = gens[name].generate(ids, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True))
                        row[name] = out.stats.tokens_per_second
                        row[name + " drafted"] = len(out.stats.budgets)
                    bar.update()
                rows.append(row)
    finally:
        lab.close()
    print(f"{len(rows)} runs ({args.rounds} rounds of {len(prompts)} prompts), {args.tokens} greedy tokens\n")
    print(f"| category | contestant | tok/s | x {ITSELF} | x a call per token | drafted steps |")
    print("|---|---|---|---|---|---|")
    for cat in ("code", "prose"):
        mine = [r for r in rows if r["category"] == cat]

        for name in names:
            mean = sum(float(r[name]) for r in mine) / len(mine)  # type: ignore[arg-type]
            base = name + ", a call per token"
            vs = f"{_ratio(mine, name, base):.3f}" if base in names else ""
            drafted = sum(float(r.get(name + " drafted", 0)) for r in mine) / len(mine)  # type: ignore[arg-type]
            print(f"| {cat} | {name} | {mean:.2f} | {_ratio(mine, name, ITSELF):.3f} | {vs} | {drafted:.1f} |")


def _ratio(rows: list[dict[str, object]], a: str, b: str) -> float:
    """Geometric mean of a's speed over b's, prompt by prompt."""
    return math.exp(sum(math.log(float(r[a]) / float(r[b])) for r in rows) / len(rows))  # type: ignore[arg-type]


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
