"""What penalties cost SpecExec: the quickstart's pair in one process, the bench's chat prompts,
each answered without penalties and with a chat UI's usual ones (presence 0.6, frequency 0.3), SpecExec
and the target alone, interleaved prompt by prompt.

The target applies penalties at each draw; the draft does not, so its trees keep proposing what the
penalties push down, and fewer of their tokens are accepted. Greedy. Reports tokens/s and tokens per
target step.

    .venv/bin/python -m benchmarks.penalties --out docs/structured/penalties.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tqdm import tqdm

from client.api import SpecExec, render_chat
from common.decoding.penalties import Penalties
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams

PROMPTS = Path(__file__).resolve().parents[1] / "client" / "data" / "bench_prompts.jsonl"
USUAL = Penalties(presence=0.6, frequency=0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    tasks = [r for c in ("code", "prose") for r in [r for r in rows if r["category"] == c][: args.per_category]]
    spec = SpecExec.local(args.draft, args.target, draft_quantize="int8", tree=TreeParams(budget=args.budget),
                          backend="llama.cpp")  # fmt: skip
    alone = spec.variant("autoregressive", None)
    contestants = {"SpecExec": (spec, None), "SpecExec, penalties": (spec, USUAL), "target alone, penalties": (alone, USUAL)}
    got: dict[str, list[tuple[str, float, float]]] = {name: [] for name in contestants}
    spec.generate(render_chat(spec.tokenizer, [{"role": "user", "content": "Hi"}]), max_new_tokens=8)
    for i, task in enumerate(tqdm(tasks, desc="prompts")):
        ids = render_chat(spec.tokenizer, [{"role": "user", "content": task["prompt"]}])
        names = list(contestants)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotating order
            gen, penalties = contestants[name]
            s = gen.generate(ids, SamplingParams(max_new_tokens=args.tokens, penalties=penalties)).stats
            got[name].append((task["category"], s.new_tokens / s.wall_seconds, s.new_tokens / max(s.target_steps, 1)))
    lines = [f"# Penalties and SpecExec: the quickstart pair, {len(tasks)} chat prompts, greedy, {args.tokens} tokens",
             "", f"`python -m benchmarks.penalties` (draft {args.draft} int8, target {args.target}, budget "
             f"{args.budget}, one process; presence 0.6, frequency 0.3; interleaved prompt by prompt).", "",
             "| contestant | category | tok/s (median) | tokens per target step |", "|---|---|---|---|"]  # fmt: skip
    for name, runs in got.items():
        for category in ("code", "prose"):
            mine = [r for r in runs if r[0] == category]
            lines.append(f"| {name} | {category} | {statistics.median(r[1] for r in mine):.2f} | "
                         f"{statistics.mean(r[2] for r in mine):.2f} |")  # fmt: skip
    ratios = [a[1] / b[1] for a, b in zip(got["SpecExec, penalties"], got["SpecExec"], strict=True)]
    lines += ["", f"SpecExec with penalties / without, tok/s paired by prompt: geometric mean "
              f"{statistics.geometric_mean(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})."]  # fmt: skip
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
