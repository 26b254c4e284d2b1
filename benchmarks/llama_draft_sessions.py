"""A llama.cpp draft node's sessions: one shared context against one context each.

Per contestant, in a process of its own (so that RSS is its own): the draft GGUF on llama.cpp, a
`DraftEngine` for 8 sessions, and N sessions (1, 2, 4, 8) with chat-length prompts building trees at
once from N threads, 4 steps each. Reports the process's RSS after the model, after N sessions'
trees (peak), the draft passes and the sessions per pass, and the wall time of the steps. "shared" is the
default node (one context, shared passes, common.model.llama_search.SearchPool); "own" is the node
with `--max-batch-tokens 1` (each session a context and passes of its own, as before).

    python -m benchmarks.llama_draft_sessions --draft qwen2.5-coder-0.5b --threads 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from common.decoding.tree import TreeParams
from common.model.llama_cpp import load_gguf
from common.model.store import resolve_gguf
from common.ops.hugepages import reexec_with_huge_pages
from common.ops.memory import peak_rss_bytes
from draft_node.engine import DraftEngine

PARAMS = TreeParams(budget=32, max_depth=8, max_branch=4, expand_batch=16)


def one(draft: str, contestant: str, sessions: int, threads: int) -> dict[str, float]:
    loaded = load_gguf(resolve_gguf(draft) or draft, threads=threads)
    model_mb = peak_rss_bytes() / 2**20
    engine = DraftEngine(loaded, max_sessions=8, max_tree=64, max_batch_tokens=1 if contestant == "own" else 2048)
    sids = [engine.open_session([(1000 + 37 * i + 11 * j) % 30000 for j in range(200)]) for i in range(sessions)]
    passes = {"n": 0, "sessions": 0}
    real = engine._run_searches

    def counted(jobs):  # type: ignore[no-untyped-def]
        from draft_node.engine import _passes

        for group in _passes(jobs):
            passes["n"] += 1
            passes["sessions"] += len(group)
        real(jobs)

    engine.passes.run_pass = counted
    barrier = threading.Barrier(sessions)

    def run(sid: str, i: int) -> None:
        barrier.wait()
        for step in range(4):
            engine.build_tree(sid, [] if step == 0 else [(500 + i + step) % 30000], PARAMS)

    start = time.perf_counter()
    workers = [threading.Thread(target=run, args=(sid, i)) for i, sid in enumerate(sids)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"model_mb": model_mb, "rss_mb": peak_rss_bytes() / 2**20, "seconds": time.perf_counter() - start,
            "passes": passes["n"], "sessions_per_pass": passes["sessions"] / max(passes["n"], 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.draft, args.child[0], int(args.child[1]), args.threads)))
        return
    print("| sessions | contestant | model RSS MiB | peak RSS MiB | s for 4 steps each | draft passes | sessions per pass |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sessions:
        for contestant in ("shared", "own"):
            cmd = [sys.executable, "-m", "benchmarks.llama_draft_sessions", "--draft", args.draft,
                   "--threads", str(args.threads), "--child", contestant, str(n)]  # fmt: skip
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            print(f"| {n} | {contestant} | {r['model_mb']:.0f} | {r['rss_mb']:.0f} | {r['seconds']:.2f} "
                  f"| {r['passes']} | {r['sessions_per_pass']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
