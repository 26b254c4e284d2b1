"""Could the draft guess its own chains from earlier text, and so grow a tree more than one level a
forward? Prompt lookup (vLLM's n-gram speculator) proposes the tokens that followed the last
occurrence of the current suffix; one draft pass over a guess of k tokens checks all k at once.

The home lab's code steps are bound by the draft's per-level latency (docs/benchmarks.md, "What bounds
it, simulated"): one forward a level through text the draft is sure of. This measures the most such
guessing could give there: on the target's own greedy texts, walking each text as a draft would,
one forward takes the guessed tokens that match plus one of its own. The table gives levels a
forward (1.00: guessing never helps), for suffixes of at least 1, 2 or 3 tokens.

    .venv/bin/python -m benchmarks.prompt_lookup --per-category 5 --tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.bench.harness import load_prompts
from common.decoding.sampling import SamplingParams


def guess(context: list[int], longest: int, shortest: int, k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix."""
    for n in range(longest, shortest - 1, -1):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def levels_per_forward(prompt: list[int], text: list[int], shortest: int, longest: int = 4, k: int = 8) -> float:
    """Tokens of `text` over the forwards a draft guessing from prompt + text so far would take."""
    at = forwards = 0
    while at < len(text):
        proposal = guess(prompt + text[:at], longest, shortest, k)
        hits = next((i for i, t in enumerate(proposal) if at + i >= len(text) or t != text[at + i]), len(proposal))
        at += hits + 1
        forwards += 1
    return len(text) / max(forwards, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--categories", nargs="+", default=["code", "prose", "chat"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gen = SpecExec.local(None, args.target, backend="llama.cpp", mode="autoregressive")
    prompts = [q for c in args.categories for q in load_prompts(None, args.per_category, [c])]
    texts = []
    for q in tqdm(prompts, desc="greedy texts", unit="prompt"):
        ids = render_chat(gen.tokenizer, [{"role": "user", "content": q["prompt"]}])
        out = gen.generate(ids, SamplingParams(max_new_tokens=args.tokens, temperature=0))
        texts.append({"category": q["category"], "prompt": ids, "text": out.token_ids})
    lines = ["| category | texts | tokens | levels a forward, suffix >= 1 | >= 2 | >= 3 |", "|---|---|---|---|---|---|"]
    for category in args.categories:
        mine = [t for t in texts if t["category"] == category]
        tokens = sum(len(t["text"]) for t in mine)
        cells = []
        for shortest in (1, 2, 3):
            forwards = sum(len(t["text"]) / levels_per_forward(t["prompt"], t["text"], shortest) for t in mine)
            cells.append(f"{tokens / forwards:.2f}")
        lines.append(f"| {category} | {len(mine)} | {tokens} | {' | '.join(cells)} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(table + "\n")
        (args.out / "texts.json").write_text(json.dumps(texts))


if __name__ == "__main__":
    main()
