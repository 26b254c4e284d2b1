"""How far a quantized GGUF's tree passes on llama.cpp's CPU kernels stand from its one-token passes,
and how often that moves SpecExec's text off the target alone's.

Rows: the logits of the row after the prompt, computed as the first row of passes of 1 to 64 rows,
against the one-row pass, with and without llama.cpp's repacked weights (max |difference| over the
vocabulary; 0 is bit-identical). Texts: SpecExec in process (the target's GGUF on llama.cpp, the int8
draft) against the same target alone, greedy and seeded, at fixed budgets, chat prompts from the
bench's set; the first token where the two texts part, if they do.

    .venv/bin/python -m benchmarks.quantized_exactness --per-category 4 --tokens 64 --out docs/quantized-exactness
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.bench.harness import load_prompts
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.llama_cpp import load_gguf

ROW_COUNTS = (1, 2, 3, 4, 7, 8, 9, 16, 64)


def row_classes(target: str, prompt: str) -> dict[str, list[float]]:
    """Per repack setting: row 0's max |logit difference| from the one-row pass, per pass size."""
    out = {}
    for repack in (True, False):
        loaded = load_gguf(target, repack=repack)
        ids = loaded.tokenizer.encode(prompt)
        diffs, first = [], None
        for n in ROW_COUNTS:
            lane = loaded.model.new_context(512, max(ROW_COUNTS))
            lane.extend(ids[:-1])
            tokens = np.array([ids[-1], *range(100, 99 + n)])
            logits = lane.tree(tokens, np.array([-1] + [0] * (n - 1)))[0]
            lane.close()
            first = logits if first is None else first
            diffs.append(float(np.abs(logits - first).max()))
        out["repacked" if repack else "not repacked"] = diffs
        loaded.model.close()
    return out


def parting(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def texts(target: str, draft: str, prompts: list[dict], tokens: int, budgets: list[int], seed: int) -> list[dict]:
    gen = SpecExec.local(draft, target, backend="llama.cpp", draft_quantize="int8", tree=TreeParams(budget=max(budgets)))
    alone = gen.variant("autoregressive", None)
    rows = []
    samplings = {"greedy": SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                 "seeded": SamplingParams(temperature=0.8, seed=seed, max_new_tokens=tokens, ignore_eos=True)}  # fmt: skip
    work = [(p, kind) for p in prompts for kind in samplings]
    for p, kind in tqdm(work, desc="prompts x sampling", unit="pair"):
        ids = render_chat(gen.tokenizer, [{"role": "user", "content": p["prompt"]}])
        reference = alone.generate(ids, samplings[kind]).token_ids
        for budget in budgets:
            out = gen.variant("specexec", TreeParams(budget=budget)).generate(ids, samplings[kind])
            rows.append({"category": p["category"], "sampling": kind, "budget": budget,
                         "parts_at": parting(reference, out.token_ids),
                         "tokens_per_step": round(out.stats.tokens_per_step, 2)})  # fmt: skip
    return rows


def report(classes: dict[str, list[float]], rows: list[dict], tokens: int) -> str:
    lines = ["# Quantized tree passes on llama.cpp: how far from one-token passes", "",
             "Row 0's logits in a pass of n rows, max |difference| from the one-row pass:", "",
             "| weights | " + " | ".join(f"n={n}" for n in ROW_COUNTS) + " |",
             "|---|" + "---|" * len(ROW_COUNTS)]  # fmt: skip
    lines += [f"| {k} | " + " | ".join(f"{d:.3f}" for d in v) + " |" for k, v in classes.items()]
    lines += ["", f"SpecExec against the target alone, {tokens} tokens a prompt (greedy; seeded at temperature 0.8):", "",
              "| sampling | budget | prompts | texts parted | first parting (median) | tokens/step (median) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for kind in ("greedy", "seeded"):
        for budget in sorted({r["budget"] for r in rows}):
            cell = [r for r in rows if r["sampling"] == kind and r["budget"] == budget]
            parted = [r["parts_at"] for r in cell if r["parts_at"] is not None]
            at = f"{np.median(parted):.0f}" if parted else "-"
            steps = np.median([r["tokens_per_step"] for r in cell])
            lines.append(f"| {kind} | {budget} | {len(cell)} | {len(parted)} | {at} | {steps:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--categories", nargs="+", default=["code", "prose", "chat"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16])
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    prompts = [q for c in args.categories for q in load_prompts(None, args.per_category, [c])]
    classes = row_classes(args.target, prompts[0]["prompt"])
    rows = texts(args.target, args.draft, prompts, args.tokens, args.budgets, args.seed)
    text = report(classes, rows, args.tokens)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps({"row_classes": classes, "texts": rows}, indent=1))


if __name__ == "__main__":
    main()
