"""How long a tree request waits for the draft's lookahead, with the pass in flight cut short
(llama.cpp's abort callback; torch: between layers) and without, interleaved, on one pinned core.

A client is played in process against a draft engine with its lookahead on: build a tree,
stand aside for a target pass of `--target-ms` (jittered +-50%) while the lookahead grows the search,
then send the tree's first 1-3 tokens plus one more, as an accepted path and the target's own token,
and time how long the request waited for the session (`StepTiming.queue_seconds`). Blocks of steps
alternate between the two contestants, each on a session of its own, so drift hits both alike.

    python -m benchmarks.lookahead_wait --draft qwen2.5-coder-0.5b --steps 60
    python -m benchmarks.lookahead_wait --backend torch --steps 60   # the int8 torch draft
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from common.decoding.tree import TreeParams
from common.model.llama_cpp import load_gguf
from common.model.loading import load_model
from common.model.store import resolve_model
from common.ops.hugepages import reexec_with_huge_pages
from common.runtime.sessions import StepTiming
from draft_node.engine import DraftEngine
from draft_node.llama_session import LlamaDraftSession
from draft_node.session import DraftSession

PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"


def run_block(engine: DraftEngine, sid: str, steps: int, target_s: float, rng: random.Random) -> list[float]:
    params = TreeParams(budget=32, max_depth=8, max_branch=4, expand_batch=16)
    waits, new_tokens = [], []
    for _ in range(steps):
        timing = StepTiming()
        tree = engine.build_tree(sid, new_tokens, params, timing=timing).tree
        waits.append(timing.queue_seconds)
        time.sleep(target_s * rng.uniform(0.5, 1.5))  # the target verifies; the lookahead grows
        path, node = [], 0
        for _ in range(rng.randint(1, 3)):
            children = (tree.parents == node).nonzero().flatten()
            if children.numel() == 0:
                break
            node = int(children[0])
            path.append(int(tree.tokens[node]))
        new_tokens = [*path, int(tree.tokens[0])]  # accepted path plus a token of the target's own
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a model path, or an installed model's name")
    ap.add_argument("--backend", choices=("llama.cpp", "torch"), default="llama.cpp",
                    help="llama.cpp: the draft's GGUF; torch: its checkpoint, int8 as the quickstart runs it")  # fmt: skip
    ap.add_argument("--steps", type=int, default=60, help="tree requests per contestant")
    ap.add_argument("--block", type=int, default=10, help="steps in a row before the other contestant's turn")
    ap.add_argument("--target-ms", type=float, default=250.0, help="the target pass the lookahead runs beside")
    ap.add_argument("--core", type=int, default=0, help="the one core the draft runs on")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    if args.backend == "llama.cpp":
        loaded, session_type = load_gguf(args.draft, threads=1), LlamaDraftSession
    else:
        loaded = load_model(resolve_model(args.draft), dtype="float32", quantize="int8")
        session_type = DraftSession
    engine = DraftEngine(loaded, lookahead=True, max_context=1024, max_tree=128, max_sessions=4)
    assert engine.lookahead is not None
    engine.lookahead.alone_seconds = 0.0  # two sessions take turns in blocks: grow whichever was served last
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    cut_short = session_type.interrupt
    contestants = {"cut short": cut_short, "run to the end": lambda self: None}
    sessions = {name: engine.open_session(prompt) for name in contestants}
    waits: dict[str, list[float]] = {name: [] for name in contestants}
    rng = random.Random(0)
    try:
        for _ in range(0, args.steps, args.block):
            for name, interrupt in contestants.items():
                session_type.interrupt = interrupt  # type: ignore[method-assign]
                waits[name] += run_block(engine, sessions[name], args.block, args.target_ms / 1000, rng)
    finally:
        session_type.interrupt = cut_short  # type: ignore[method-assign]
        engine.close()
    print(f"draft {args.draft} ({args.backend}), 1 thread on core {args.core}, target pass {args.target_ms:.0f} ms +-50%, "
          f"{engine.lookahead.interrupted} idle passes cut short")  # fmt: skip
    print("| lookahead pass | requests | mean wait ms | median ms | p90 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for name, w in waits.items():
        ms = sorted(x * 1000 for x in w[1:])  # the first request opens the search: nothing to wait for
        print(f"| {name} | {len(ms)} | {statistics.mean(ms):.1f} | {statistics.median(ms):.1f} | "
              f"{ms[int(0.9 * (len(ms) - 1))]:.1f} | {ms[-1]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
