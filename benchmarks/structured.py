"""What a grammar costs SpecExec: the quickstart's pair in one process, chat prompts that ask for JSON,
each answered without a grammar and under its JSON schema (as `response_format` sends it), SpecExec
and the target alone, interleaved prompt by prompt.

The draft's search proposes only what the grammar allows; a contestant whose draft is blind to it
shows what that brings (without it the draft proposes a ```json fence, keys out of the schema's
order, ...). The mask itself costs each draw, and each expanded draft node, a matcher step.
Greedy. Reports tokens/s, tokens per target step, and how many answers parse and fit their schema.

    .venv/bin/python -m benchmarks.structured --out docs/structured/report.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.bench.stats import paired
from common.decoding.grammar import Constraint, Grammar
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams


def obj(required: list[str], **properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
TASKS = [
    ("Describe the book 'Dune' as JSON with its title, author, year and whether it is a series.",
     obj(["title", "author", "year", "series"], title=STR, author=STR, year=INT, series=BOOL)),
    ("Give me a JSON object for a user account: username, email, age and whether they are an admin.",
     obj(["username", "email", "age", "admin"], username=STR, email=STR, age=INT, admin=BOOL)),
    ("List three European capitals as JSON: an object with a 'cities' array of {name, country, population}.",
     obj(["cities"], cities={"type": "array", "items": obj(["name", "country", "population"], name=STR, country=STR,
                                                             population=INT)})),
    ("Write a package.json-like JSON object for a project named 'tiny-http' with version, description "
     "and a 'scripts' object holding 'test' and 'build'.",
     obj(["name", "version", "description", "scripts"], name=STR, version=STR, description=STR,
         scripts=obj(["test", "build"], test=STR, build=STR))),
    ("Return the weather for Oslo as JSON: city, temperature in Celsius, humidity percent, and a short summary.",
     obj(["city", "temperature", "humidity", "summary"], city=STR, temperature=NUM, humidity=INT, summary=STR)),
    ("A recipe for pancakes as JSON: name, servings, and an 'ingredients' array of strings.",
     obj(["name", "servings", "ingredients"], name=STR, servings=INT, ingredients={"type": "array", "items": STR})),
]  # fmt: skip


def fits(text: str, schema: dict) -> tuple[bool, bool]:
    """Whether the answer parses as JSON (after a fence, as a client would strip it), and whether it
    has the schema's required keys."""
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        value = json.loads(body)
    except ValueError:
        return False, False
    return True, isinstance(value, dict) and all(k in value for k in schema["required"])


class Blind:
    """A draft backend that builds its trees without the request's grammar."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def build_tree(self, *args: object, grammar: object = None, **kwargs: object) -> object:
        return self.inner.build_tree(*args, **kwargs)  # type: ignore[attr-defined]


def mask_cost(gen: SpecExec, schema: dict, draws: int = 200) -> float:
    """Milliseconds a draw spends in the matcher (mask and step) on the target's vocabulary."""
    loaded = getattr(gen.target, "loaded", None)
    if loaded is None:
        return float("nan")
    constraint = Constraint(Grammar.json_schema(schema).at(0), loaded.grammar_tokenizer(), loaded.model.cfg.vocab_size)
    logits = np.random.default_rng(0).standard_normal((1, loaded.model.cfg.vocab_size)).astype(np.float32)
    start, done = time.perf_counter(), 0
    for _ in range(draws):
        masked = constraint.mask(logits)
        token = int(masked.argmax())
        if token in constraint.eos:
            break
        constraint.consume(token)
        done += 1
    return 1000 * (time.perf_counter() - start) / max(done, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    tree = TreeParams(budget=args.budget)
    spec = SpecExec.local(args.draft, args.target, draft_quantize="int8", tree=tree, backend="llama.cpp")
    alone = spec.variant("autoregressive", None)
    blind = spec.variant("specexec", tree)
    blind.draft = Blind(spec.draft)  # the grammar withheld from the draft's search, as before it took one
    contestants = {"SpecExec": (spec, False), "SpecExec, schema": (spec, True),
                   "SpecExec, schema, draft blind to it": (blind, True), "target alone, schema": (alone, True)}
    spec.target.loaded.grammar_tokenizer()  # built once per node, at its first grammar: not timed here
    spec.draft.loaded.grammar_tokenizer()
    rows: dict[str, list[tuple[float, float, bool, bool]]] = {name: [] for name in contestants}
    warm = render_chat(spec.tokenizer, [{"role": "user", "content": "Hi"}])
    spec.generate(warm, max_new_tokens=8)
    for i, (task, schema) in enumerate(tqdm(TASKS, desc="prompts")):
        ids = render_chat(spec.tokenizer, [{"role": "user", "content": task}])
        names = list(contestants)
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotating order
            gen, constrained = contestants[name]
            grammar = Grammar.json_schema(schema) if constrained else None
            out = gen.generate(ids, SamplingParams(max_new_tokens=args.tokens, grammar=grammar))
            s = out.stats
            rows[name].append((s.new_tokens / s.wall_seconds, s.new_tokens / max(s.target_steps, 1), *fits(out.text, schema)))
    lines = [
        f"# Grammars and SpecExec: the quickstart pair, {len(TASKS)} JSON prompts, greedy, {args.tokens} tokens",
        "",
        f"`python -m benchmarks.structured` (draft {args.draft} int8, target {args.target}, budget {args.budget}, "
        "one process on this machine's cores; contestants interleaved prompt by prompt).",
        "",
        "| contestant | tok/s (median) | tokens per target step | answers that parse | with the schema's keys |",
        "|---|---|---|---|---|",
    ]
    for name, got in rows.items():
        lines.append(f"| {name} | {statistics.median(r[0] for r in got):.2f} | "
                     f"{statistics.mean(r[1] for r in got):.2f} | {sum(r[2] for r in got)}/{len(got)} | "
                     f"{sum(r[3] for r in got)}/{len(got)} |")  # fmt: skip
    lines.append("")
    for name in ("SpecExec, schema", "SpecExec, schema, draft blind to it"):
        ratios = [a[0] / b[0] for a, b in zip(rows[name], rows["SpecExec"], strict=True)]
        lines.append(f"{name} / SpecExec without one, tok/s paired by prompt: {paired(ratios)}.")
    lines += ["", f"A draw's matcher step on the target's vocabulary: {mask_cost(spec, TASKS[0][1]):.3f} ms."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
