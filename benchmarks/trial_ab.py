"""Does a request still try trees first where they never pay? One process, 2 threads, the quickstart's
pair (the 1.5B GGUF on llama.cpp, the int8 0.5B draft on torch), greedy, interleaved per prompt in
alternating order: llama.cpp itself, our target alone, `--budget auto` with every request trying
trees on its first steps ("trial always"), with the trial skipped after TRIALS_DECLINED requests in
a row whose trees did not pay but each request exploring on its own count ("explore per request"),
and as shipped (those requests explore on one count of the regime's steps). Four untimed requests
first give the planners a history.

    python -m benchmarks.trial_ab [--prompts 8] [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math

import torch

from client.api import SpecExec
from client.bench.harness import encode, load_prompts
from client.bench.llama_cpp import LlamaItself
from common.decoding.tree import TreeParams
from common.model.llama_cpp import find_gguf
from common.model.store import resolve_gguf, resolve_model
from common.ops.hugepages import reexec_with_huge_pages

NAMES = ("llama.cpp itself", "target alone", "trial always", "explore per request", "as shipped")


def ab_args(doc: str) -> argparse.Namespace:
    """The options of the one-process A/B benchmarks (this one, benchmarks/planner_memory.py)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def print_table(runs: list[dict[str, float | str]], names: tuple[str, ...]) -> None:
    """Per category, each contestant's mean tok/s, its geometric-mean ratio to the first and its
    drafted steps a request."""
    print(f"| category | contestant | tok/s | x {names[0]} | drafted steps a request |")
    print("|---|---|---|---|---|")
    for cat in ("code", "prose"):
        mine = [r for r in runs if r["category"] == cat]
        for name in names:
            ratio = math.exp(sum(math.log(float(r[name]) / float(r[names[0]])) for r in mine) / len(mine))
            drafted = sum(float(r.get(name + " drafted", 0)) for r in mine) / len(mine)
            print(f"| {cat} | {name} | {sum(float(r[name]) for r in mine) / len(mine):.2f} | {ratio:.3f} "
                  f"| {drafted:.1f} |")  # fmt: skip


def main() -> None:
    args = ab_args(__doc__)
    tree = TreeParams(budget=64)
    gguf = resolve_gguf("qwen2.5-coder-1.5b")
    shipped = SpecExec.local(str(resolve_model("qwen2.5-coder-0.5b")), str(gguf), draft_quantize="int8",
                             auto_budget=True, tree=tree)  # fmt: skip
    always = SpecExec(shipped.target, shipped.draft, shipped.tokenizer, tree=tree, auto_budget=True)
    assert always.planner is not None
    always.planner.trials_declined = 10**9
    per_request = SpecExec(shipped.target, shipped.draft, shipped.tokenizer, tree=tree, auto_budget=True)
    assert per_request.planner is not None
    per_request.planner.explore_across = False
    alone = shipped.variant("autoregressive", None)
    itself = LlamaItself(find_gguf(gguf), args.threads)
    prompts = load_prompts(None, args.prompts + 4, ("code", "prose"))
    for p in prompts[:4]:
        for gen in (shipped, always, per_request):
            gen.generate(encode(shipped.tokenizer, p["prompt"]), max_new_tokens=args.tokens)
    runs: list[dict[str, float | str]] = []
    try:
        for rnd in range(args.rounds):
            for p in prompts[4:]:
                ids = encode(shipped.tokenizer, p["prompt"])
                row: dict[str, float | str] = {"category": p["category"]}
                contestants = list(zip(NAMES, (None, alone, always, per_request, shipped), strict=True))
                for name, gen in contestants[:: -1 if rnd % 2 else 1]:
                    if gen is None:
                        tokens, wall = itself(ids, args.tokens)
                        row[name] = len(tokens) / wall
                    else:
                        out = gen.generate(ids, max_new_tokens=args.tokens)
                        row[name] = out.stats.tokens_per_second
                        row[name + " drafted"] = len(out.stats.budgets)
                runs.append(row)
    finally:
        itself.close()
    print_table(runs, NAMES)


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
