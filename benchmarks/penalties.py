"""What penalties cost SpecExec: the quickstart's pair in one process, the bench's chat prompts,
each answered without penalties and with them, SpecExec and the target alone, interleaved prompt by
prompt. `--setting chat-ui`: a chat UI's usual presence 0.6 and frequency 0.3, greedy. `--setting
ollama`: what every request through Ollama's API gets by default, sampled (temperature 0.8, top_k 40,
top_p 0.9, seeded) with and without repeat_penalty 1.1 over the last 64 tokens.

The target applies penalties at each draw; the draft does not, so its trees keep proposing what the
penalties push down, and fewer of their tokens are accepted. Reports tokens/s and tokens per target
step.

    .venv/bin/python -m benchmarks.penalties --out docs/structured/penalties.md
    .venv/bin/python -m benchmarks.penalties --setting ollama --out docs/structured/penalties-ollama.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.bench.stats import paired
from common.decoding.penalties import Penalties
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams

PROMPTS = Path(__file__).resolve().parents[1] / "client" / "data" / "bench_prompts.jsonl"
SETTINGS = {  # name: (sampling for every contestant, the penalties added, what the report says)
    "chat-ui": ({}, Penalties(presence=0.6, frequency=0.3), "greedy; presence 0.6, frequency 0.3"),
    "ollama": (dict(temperature=0.8, top_k=40, top_p=0.9), Penalties(repetition=1.1, repetition_window=64),
               "Ollama's defaults: temperature 0.8, top_k 40, top_p 0.9, seeded; repeat_penalty 1.1 over 64 tokens"),
}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--setting", choices=sorted(SETTINGS), default="chat-ui")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    tasks = [r for c in ("code", "prose") for r in [r for r in rows if r["category"] == c][: args.per_category]]
    spec = SpecExec.local(args.draft, args.target, draft_quantize="int8", tree=TreeParams(budget=args.budget),
                          backend="llama.cpp")  # fmt: skip
    alone = spec.variant("autoregressive", None)
    sampling, usual, said = SETTINGS[args.setting]
    contestants = {"SpecExec": (spec, None), "SpecExec, penalties": (spec, usual), "target alone, penalties": (alone, usual)}
    got: dict[str, list[tuple[str, float, float]]] = {name: [] for name in contestants}
    spec.generate(render_chat(spec.tokenizer, [{"role": "user", "content": "Hi"}]), max_new_tokens=8)
    for i, task in enumerate(tqdm(tasks, desc="prompts")):
        ids = render_chat(spec.tokenizer, [{"role": "user", "content": task["prompt"]}])
        names = list(contestants)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotating order
            gen, penalties = contestants[name]
            s = gen.generate(ids, SamplingParams(max_new_tokens=args.tokens, penalties=penalties, seed=i,
                                                 **sampling)).stats  # fmt: skip
            got[name].append((task["category"], s.new_tokens / s.wall_seconds, s.new_tokens / max(s.target_steps, 1)))
    lines = [f"# Penalties and SpecExec: the quickstart pair, {len(tasks)} chat prompts, {args.tokens} tokens",
             "", f"`python -m benchmarks.penalties --setting {args.setting}` (draft {args.draft} int8, target "
             f"{args.target}, budget {args.budget}, one process; {said}; interleaved prompt by prompt).", "",
             "| contestant | category | tok/s (median) | tokens per target step |", "|---|---|---|---|"]  # fmt: skip
    for name, runs in got.items():
        for category in ("code", "prose"):
            mine = [r for r in runs if r[0] == category]
            lines.append(f"| {name} | {category} | {statistics.median(r[1] for r in mine):.2f} | "
                         f"{statistics.mean(r[2] for r in mine):.2f} |")  # fmt: skip
    ratios = [a[1] / b[1] for a, b in zip(got["SpecExec, penalties"], got["SpecExec"], strict=True)]
    lines += ["", f"SpecExec with penalties / without, tok/s paired by prompt: {paired(ratios)}."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
