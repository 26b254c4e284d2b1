"""Where a draft node's tree build spends its time: the model's forward passes, its LM head, and the
rest (the tree builder, sampling the children, the KV bookkeeping). The home lab's pipelined steps are
bound by the draft (docs/benchmarks.md, "What limits us now"); this says whether our own loop or the
model is what a faster draft would have to cut.

One thread, as a draft node on a machine of its own runs; a code prompt walked a few tokens a step,
as verification would accept them.

    taskset -c 1 .venv/bin/python -m benchmarks.draft_build --draft qwen2.5-coder-0.5b --quantize int8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from common.decoding.tree import TreeParams
from common.model.loading import load_model
from common.model.store import resolve_model
from draft_node.engine import DraftEngine

PROMPT = 'def quicksort(items):\n    """Sort a list of numbers."""\n    if len(items) <= 1:\n        return items\n'
ACCEPTED = (
    "    pivot = items[0]\n    left = [x for x in items[1:] if x < pivot]\n"
    "    right = [x for x in items[1:] if x >= pivot]\n    return quicksort(left) + [pivot] + quicksort(right)\n"
)


def timed(seconds: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--quantize", default="int8", choices=["none", "int8", "int4"])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--min-prob", type=float, default=0.3)
    p.add_argument("--accept", type=int, default=3, help="tokens committed between two trees")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(resolve_model(args.draft), dtype="float32", quantize=args.quantize)
    engine = DraftEngine(loaded, max_context=2048, max_tree=max(64, args.budget))
    tokens = loaded.tokenizer.encode(ACCEPTED)
    params = TreeParams(budget=args.budget, max_depth=16, max_branch=8, expand_batch=2, min_prob=args.min_prob,
                        min_node_prob=0.05)  # fmt: skip
    session = engine.open_session(loaded.tokenizer.encode(PROMPT))
    engine.build_tree(session, [], params)  # the prompt's pass, and warm-up
    model = loaded.model
    forward, head = [0.0], [0.0]
    model.forward_segments, model.logits = timed(forward, model.forward_segments), timed(head, model.logits)
    steps, forwards, start = 0, 0, time.perf_counter()
    for at in range(0, len(tokens), args.accept):
        forwards += engine.build_tree(session, tokens[at : at + args.accept], params).draft_forwards
        steps += 1
    wall = time.perf_counter() - start
    rest = wall - forward[0] - head[0]
    print(f"{args.draft} ({args.quantize}), budget {args.budget}, min-prob {args.min_prob}, one thread, {steps} trees")
    print("| per tree | ms | share |\n|---|---|---|")
    for name, seconds in (("forward passes", forward[0]), ("LM head", head[0]), ("the rest", rest), ("all", wall)):
        print(f"| {name} | {1e3 * seconds / steps:.1f} | {seconds / wall:.0%} |")
    print(f"{forwards / steps:.1f} expansions a tree (and one catch-up pass)")


if __name__ == "__main__":
    main()
