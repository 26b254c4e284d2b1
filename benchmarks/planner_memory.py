"""What one-shot runs gain from the planner's kept state. Each `specexec generate` is a process of
one request: its planner starts afresh ("fresh planner") unless it reads what earlier runs on the
pair taught ("kept state", client.planner_state). One process, 2 threads, the quickstart's pair
(the 1.5B GGUF on llama.cpp, the int8 0.5B draft on torch), greedy; per prompt, in alternating
order, the target alone, a fresh planner and one that reads and then writes the kept state, each a
generator of its own as in a process of its own. The state starts empty, so the first requests of
"kept state" are as fresh as the others.

    python -m benchmarks.planner_memory [--prompts 8] [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmarks.trial_ab import ab_args, print_table
from client.api import SpecExec
from client.bench.harness import encode, load_prompts
from common.decoding.tree import TreeParams
from common.model.store import resolve_gguf, resolve_model
from common.ops.hugepages import reexec_with_huge_pages

NAMES = ("target alone", "fresh planner", "kept state")


def main() -> None:
    args = ab_args(__doc__)
    tree = TreeParams(budget=64)
    base = SpecExec.local(str(resolve_model("qwen2.5-coder-0.5b")), str(resolve_gguf("qwen2.5-coder-1.5b")),
                          draft_quantize="int8", auto_budget=True, tree=tree)  # fmt: skip
    alone = base.variant("autoregressive", None)
    prompts = load_prompts(None, args.prompts, ("code", "prose"))
    base.generate(encode(base.tokenizer, prompts[0]["prompt"]), max_new_tokens=8)  # warm both models
    runs: list[dict[str, float | str]] = []
    with tempfile.TemporaryDirectory() as kept:

        def process(name: str) -> SpecExec:
            """A generator as a new `specexec generate` process would make it."""
            if name == NAMES[0]:
                return alone
            directory = Path(kept) if name == NAMES[2] else None
            return SpecExec(base.target, base.draft, base.tokenizer, tree=tree, auto_budget=True, planner_dir=directory)

        work = [(rnd, p) for rnd in range(args.rounds) for p in prompts]
        for i, (rnd, p) in enumerate(tqdm(work, desc="requests", unit="prompt")):
            ids = encode(base.tokenizer, p["prompt"])
            row: dict[str, float | str] = {"category": p["category"], "round": rnd}
            for name in NAMES[:: -1 if i % 2 else 1]:
                out = process(name).generate(ids, max_new_tokens=args.tokens)
                row[name] = out.stats.tokens_per_second
                row[name + " drafted"] = len(out.stats.budgets)
            runs.append(row)
    print_table(runs, NAMES)
    print("\nper request, in order: category, then tok/s of " + ", ".join(NAMES))
    for r in runs:
        print(f"{r['category']:6} " + "  ".join(f"{float(r[n]):6.2f}" for n in NAMES))


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
