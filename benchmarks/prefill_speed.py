"""How fast a prompt is read: our llama.cpp target engine against llama.cpp itself (llama-cpp-python,
its default n_batch 512), on the same GGUF, one thread on one core, in turns.

An editor plugin's request is mostly prompt (benchmarks/editor_flow.py): this says whether our
node reads one as fast as llama.cpp's own loop. Each contestant runs in a process of its own that
holds only its model, the processes alternating.

    python -m benchmarks.prefill_speed --tokens 1200 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("client/prompt_cache.py", "common/decoding/tree.py", "client/generation.py")
CONTESTANTS = ("llama.cpp itself", "our target engine")


def run_one(contestant: str, gguf: Path, tokens: int) -> float:
    """Seconds to read the prompt, in this process (one thread, core 1)."""
    os.sched_setaffinity(0, {1})
    text = "".join((ROOT / path).read_text() for path in TEXT)
    if contestant == CONTESTANTS[0]:
        from llama_cpp import Llama

        llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=1, n_threads_batch=1, verbose=False)
        ids = llm.tokenize(text.encode())[:tokens]
        llm.eval(ids[:64])  # untimed: first-call costs stay out
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - started
    import numpy as np

    from common.decoding.sampling import SamplingParams
    from common.decoding.tree import TokenTree
    from common.model.llama_cpp import load_gguf
    from target_node.engine import TargetEngine

    loaded = load_gguf(gguf, threads=1)
    engine = TargetEngine(loaded, max_context=4096, max_tree=64)
    ids = loaded.tokenizer.encode(text)[:tokens]
    warm = engine.open_session(ids[:64])
    engine.verify(warm, TokenTree(np.array([ids[63]]), np.array([-1])), SamplingParams(), 1)
    engine.close_session(warm)  # nothing to share a prefix from
    session = engine.open_session(list(ids))
    started = time.perf_counter()
    engine.verify(session, TokenTree(np.array([ids[-1]]), np.array([-1])), SamplingParams(), 1)  # the prompt, then one draw
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="an installed model with its GGUF")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=CONTESTANTS, help=argparse.SUPPRESS)  # a contestant's own process
    args = parser.parse_args()
    from common.model.llama_cpp import find_gguf
    from common.model.store import resolve_gguf

    found = resolve_gguf(args.model)
    gguf = find_gguf(Path(found)) if found is not None else None
    if gguf is None:
        raise SystemExit(f"no GGUF for {args.model!r}: run `specexec models install {args.model} --format gguf`")
    if args.one:
        print(run_one(args.one, gguf, args.tokens))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seconds: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    for r in range(args.rounds):
        for name in CONTESTANTS if r % 2 == 0 else reversed(CONTESTANTS):
            out = subprocess.run([sys.executable, "-m", "benchmarks.prefill_speed", "--model", args.model, "--tokens",
                                  str(args.tokens), "--one", name], env=env, check=True, capture_output=True, text=True)  # fmt: skip
            seconds[name].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {args.tokens / seconds[name][-1]:.1f} tok/s", flush=True)
    print(f"\n{args.tokens} prompt tokens of {gguf.name} ({args.model}), one thread on core 1, {args.rounds} rounds:\n")
    print("| contestant | tok/s, median | runs |\n|---|---|---|")
    for name, values in seconds.items():
        rates = [args.tokens / s for s in values]
        print(f"| {name} | {statistics.median(rates):.1f} | {', '.join(f'{x:.1f}' for x in rates)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
