"""Per-step time breakdown of SpecExec decoding: draft model, target model, and bookkeeping.

Bookkeeping is everything outside the two models' forward passes and LM heads: tree growth, masks,
sampling, acceptance and KV-cache pruning. It is measured by timing the model calls and subtracting.

    .venv/bin/python -m benchmarks.bench_step --target-model DIR --draft-model DIR --budget 16 64 256
    .venv/bin/python -m benchmarks.bench_step --tiny     # random tiny models, no download
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.loading import load_model
from common.model.store import resolve_model
from common.model.transformer import Transformer
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

PROMPTS = [
    'def quicksort(items):\n    """Sort a list of numbers."""\n',
    "The history of the printing press begins",
]


class ModelClock:
    """Accumulates wall time spent inside a model's forward and LM-head calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def attach(self, model: Transformer):
        forward, logits = model.forward, model.logits

        def timed(fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            return wrapper

        model.forward, model.logits = timed(forward), timed(logits)
        try:
            yield self
        finally:
            del model.forward, model.logits


def run(args: argparse.Namespace) -> list[dict]:
    target_loaded = load_model(args.target_model, dtype=args.dtype)
    draft_loaded = load_model(args.draft_model, dtype=args.dtype)
    rows = []
    for budget in args.budget:
        tree = TreeParams(
            budget=budget,
            max_depth=args.max_depth,
            max_branch=args.max_branch,
            expand_batch=args.expand_batch,
        )
        target = TargetEngine(target_loaded, max_tree=budget)
        draft = DraftEngine(draft_loaded, max_tree=budget)
        gen = SpecExec(target, draft, target_loaded.tokenizer, tree=tree)
        gen.generate(PROMPTS[0], max_new_tokens=4)  # warm-up
        t_clock, d_clock = ModelClock(), ModelClock()
        steps = tokens = 0
        draft_s = target_s = wall = 0.0
        with t_clock.attach(target_loaded.model), d_clock.attach(draft_loaded.model):
            for prompt in PROMPTS:
                out = gen.generate(
                    prompt, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
                )
                steps += out.stats.target_steps
                tokens += out.stats.new_tokens
                draft_s += out.stats.draft_seconds
                target_s += out.stats.target_seconds
                wall += out.stats.wall_seconds
        step_s = wall / steps
        bookkeeping = (draft_s - d_clock.seconds) + (target_s - t_clock.seconds)
        rows.append(
            dict(
                budget=budget,
                tokens_per_step=tokens / steps,
                tokens_per_s=tokens / wall,
                step_ms=1e3 * step_s,
                draft_model_ms=1e3 * d_clock.seconds / steps,
                target_model_ms=1e3 * t_clock.seconds / steps,
                bookkeeping_ms=1e3 * bookkeeping / steps,
                bookkeeping_share=bookkeeping / wall,
            )
        )
        print(_table(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def _table(rows: list[dict], header: bool = True) -> str:
    cols = [
        "budget",
        "tokens_per_step",
        "tokens_per_s",
        "step_ms",
        "draft_model_ms",
        "target_model_ms",
        "bookkeeping_ms",
        "bookkeeping_share",
    ]
    lines = []
    if header:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            f"{r[c]:.1%}"
            if c == "bookkeeping_share"
            else (f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]))
            for c in cols
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-model")
    p.add_argument("--draft-model")
    p.add_argument(
        "--tiny", action="store_true", help="use random tiny models (4-layer target, 1-layer draft)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--budget", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--max-depth", type=int, default=16)
    p.add_argument("--max-branch", type=int, default=8)
    p.add_argument("--expand-batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.tiny:
        from tests.tiny_models import make_tiny_model, truncate_layers

        root = Path(tempfile.mkdtemp())
        args.target_model = make_tiny_model(root / "target", layers=4, hidden=256, heads=8, kv_heads=2)
        args.draft_model = truncate_layers(args.target_model, root / "draft", keep=1)
    if not args.target_model or not args.draft_model:
        p.error("give --target-model and --draft-model, or --tiny")
    if not args.tiny:
        args.target_model, args.draft_model = (
            resolve_model(args.target_model),
            resolve_model(args.draft_model),
        )
    print(
        f"target {args.target_model}, draft {args.draft_model}, {args.dtype}, {args.threads} threads, "
        f"{args.max_new_tokens} tokens x {len(PROMPTS)} prompts, greedy"
    )
    run(args)


if __name__ == "__main__":
    main()
