"""What a pass shared by k sessions costs against one session's k-node tree, on the torch target.

Continuous batching puts each waiting session's tree in one pass (common.runtime.batching); each
session keeps its own KV cache, so a shared pass gathers k caches where a tree reads one. This
times, on one thread of `--core`, k sessions' root-only trees in one pass (`run_together`) against
one session's k-node chain, each after a `--prefix`-token prompt; the least disturbed of
`--repeats` passes, and their median.

    python -m benchmarks.shared_pass [--dtype bfloat16] [--ks 1 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree
from common.model.loading import load_model
from common.model.store import resolve_model
from common.ops.hugepages import reexec_with_huge_pages
from target_node.torch_session import TorchTargetSession


def chain(session: TorchTargetSession, n: int) -> TokenTree:
    tokens = np.array([session.committed[-1]] + [5 + i for i in range(n - 1)])
    return TokenTree(tokens, np.arange(-1, n - 1), np.zeros(n, dtype=np.float32))


def timed(steps: list[tuple[TorchTargetSession, TokenTree]]) -> float:
    """One pass over these sessions' trees; every session is left as it was."""
    tickets = [(s, s.prepare(tree, SamplingParams(), 1)) for s, tree in steps]
    start = time.perf_counter()
    TorchTargetSession.run_together(tickets)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    for s, t in tickets:
        s.abort(t)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prefix", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--core", type=int, default=1)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    model = load_model(resolve_model(args.model), dtype=args.dtype).model
    sessions = []
    for i in range(max(args.ks)):
        prompt = [(7 * j + 11 * i + 3) % 5000 + 100 for j in range(args.prefix)]
        s = TorchTargetSession(model, prompt, max_context=args.prefix + 64, max_tree=64, max_depth=64, eos_token_ids=())
        root = TokenTree(np.array([prompt[-1]]), np.array([-1]), np.zeros(1, dtype=np.float32))
        ticket = s.prepare(root, SamplingParams(), 1)
        s.finish(ticket, s.run_alone(ticket))  # the prompt's KV, and one token
        sessions.append(s)
    for _ in range(3):
        timed([(sessions[0], chain(sessions[0], 1))])
    print(f"{args.model} ({args.dtype}), one thread on core {args.core}, {args.prefix}-token prompts, "
          f"{args.repeats} passes each: least disturbed (median) ms")  # fmt: skip
    print("| k | one session, k-node tree | k sessions, a root each | x |")
    print("|---|---|---|---|")
    for k in args.ks:
        tree = [timed([(sessions[0], chain(sessions[0], k))]) for _ in range(args.repeats)]
        shared = [timed([(s, chain(s, 1)) for s in sessions[:k]]) for _ in range(args.repeats)]
        print(f"| {k} | {1e3 * min(tree):.1f} ({1e3 * statistics.median(tree):.1f}) "
              f"| {1e3 * min(shared):.1f} ({1e3 * statistics.median(shared):.1f}) | {min(shared) / min(tree):.2f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
