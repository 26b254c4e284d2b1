"""`--budget auto` with different planner constants against fixed node-floored shapes, on the real pair.

The constants of `client/budget.py` were first fitted in `scripts/planner_sim.py`; this checks them
on the real models. Every contestant decodes the same prompts (the bench's balanced first N), in an
order that rotates each prompt and setting, and prints one JSON line per run, then medians per
category. The bench's own `specexec bench` cannot vary a module constant between contestants.

    .venv/bin/python scripts/auto_constants.py --limit 12 --constants 1.25,3 1.25,1 --out runs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import client.budget as budget
from client.api import SpecExec
from client.bench import GREEDY, SAMPLED, encode, load_prompts
from common.loading import load_model
from common.model_store import resolve_model
from common.quantized_linear import draft_dtype
from common.sampling import SamplingParams
from common.tree import TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--constants", nargs="+", default=["1.25,3", "1.25,1"], help="K_LEVEL,K_NODE pairs")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16], help="fixed shapes, p=0.6 q=0.05")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target_model = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype="bfloat16")
    draft_model = load_model(
        resolve_model("qwen2.5-coder-0.5b"), dtype=draft_dtype("bfloat16", "int8"), quantize="int8"
    )
    target, draft = TargetEngine(target_model, max_tree=64), DraftEngine(draft_model, max_tree=64)
    target.profile()
    draft.profile()
    tokenizer, base = target_model.tokenizer, TreeParams(budget=max(args.budgets))
    contestants: dict[str, tuple[SpecExec, tuple[float, float] | None]] = {"target alone": (
        SpecExec(target, None, tokenizer, mode="autoregressive"), None)}  # fmt: skip
    for pair in args.constants:
        k_level, k_node = (float(x) for x in pair.split(","))
        contestants[f"auto {k_level:g}/{k_node:g}"] = (
            SpecExec(target, draft, tokenizer, tree=base, auto_budget=True), (k_level, k_node))  # fmt: skip
    for b in args.budgets:
        shape = replace(base, budget=b, min_prob=0.6, min_node_prob=0.05)
        contestants[f"b={b} p=0.6 q=0.05"] = (SpecExec(target, draft, tokenizer, tree=shape), None)
    rows, names, turn = [], list(contestants), 0
    for i, prompt in enumerate(load_prompts(None, args.limit, None)):
        ids = encode(tokenizer, prompt["prompt"])
        for setting, extra in (("greedy", GREEDY), ("sampled", SAMPLED)):
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=i, **extra)
            shift, turn = turn % len(names), turn + 1
            for name in names[shift:] + names[:shift]:
                gen, constants = contestants[name]
                if constants:
                    budget.K_LEVEL, budget.K_NODE = constants
                out = gen.generate(ids, sampling)
                s = out.stats
                rows.append(dict(name=name, cat=prompt["category"], setting=setting, prompt=i,
                                 tps=len(out.token_ids) / s.wall_seconds,
                                 nodes=statistics.mean(s.budgets) if s.budgets else 0.0,
                                 acc=statistics.mean(s.accepted_per_step),
                                 ms=1000 * s.wall_seconds / s.target_steps))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps(rows))
    for setting in ("greedy", "sampled"):
        for cat in ("all", "code", "chat", "prose"):
            line = f"{setting:7s} {cat:5s}"
            for name in names:
                sel = [
                    r
                    for r in rows
                    if r["name"] == name and r["setting"] == setting and cat in ("all", r["cat"])
                ]
                line += f" | {name}: {statistics.median(r['tps'] for r in sel):.2f} ({statistics.mean(r['nodes'] for r in sel):.1f} nodes)"
            print(line)


if __name__ == "__main__":
    main()
