"""How long a long prompt stalls the other sessions on one target: chunked prefill against none.

In process on one pinned core with one thread (the target node's engine and pass loop, no gRPC):
`--others` sessions run the target alone, a pass a token (a Decode call each, as clients stream
such steps); once they run, a session opens with a `--prompt-tokens` prompt and verifies its first
step. Per contestant: the long prompt's time to its first token, alone and beside the others; the
other sessions' longest wait between two of their tokens while it prefilled, and their tokens per
second in that time. Contestants: the node's default chunk
(from its measured forward-time curve) and `--prefill-chunk` at the prompt's length (its whole
prefill in one pass, as before chunking), interleaved over `--rounds`; medians over rounds.

    python -m benchmarks.long_prompt --target qwen2.5-coder-1.5b --dtype bfloat16 --out docs/epyc/long-prompt
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree
from common.model.loading import load_model
from common.model.store import resolve_model
from common.ops.hugepages import reexec_with_huge_pages
from common.runtime.sessions import StepCancelled
from target_node.engine import TargetEngine

ROOT = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)


def decode_until(engine: TargetEngine, prompt: list[int], stop: threading.Event, stamps: list[float]) -> None:
    """A client running the target alone (one Decode call, as the client streams such steps): a
    pass a token, each token's time in `stamps`."""
    sid = engine.open_session(prompt)
    try:
        for _ in engine.decode(sid, prompt[-1], PARAMS, 1 << 20, steps=1 << 20, cancelled=stop.is_set):
            stamps.append(time.perf_counter())
    except StepCancelled:
        pass  # stopped while its next pass waited
    finally:
        engine.close_session(sid)


def one_round(engine: TargetEngine, prompt: list[int], others: list[list[int]], warm_s: float) -> dict[str, Any]:
    stop = threading.Event()
    stamps: list[list[float]] = [[] for _ in others]
    threads = [threading.Thread(target=decode_until, args=(engine, p, stop, s)) for p, s in zip(others, stamps, strict=True)]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    start = time.perf_counter()
    sid = engine.open_session(prompt)
    engine.verify(sid, TokenTree.root_only(prompt[-1]), PARAMS, 8)
    first = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    engine.close_session(sid)
    stall, tokens = 0.0, 0
    for times in stamps:
        before = [t for t in times if t <= start][-1:] or [start]
        during = [t for t in times if start < t <= first]
        points = [*before, *during, first]
        stall = max(stall, *(b - a for a, b in itertools.pairwise(points)))
        tokens += len(during)
    timeline = sorted(t - start for times in stamps for t in times if start - 2.0 <= t <= first + 2.0)
    return {"ttft_s": first - start, "stall_s": stall, "others_tok_s": tokens / (first - start), "timeline": timeline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="a model path, or an installed model's name")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--others", type=int, default=2, help="sessions decoding while the long prompt arrives")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm-s", type=float, default=2.0, help="the others decode this long before it arrives")
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="a directory for results.md, results.json and timeline.png")
    args = ap.parse_args()
    reexec_with_huge_pages()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    loaded = load_model(resolve_model(args.target), dtype=args.dtype)
    engine = TargetEngine(loaded, max_context=4096, max_tree=64, max_sessions=args.others + 2)
    engine.profile()
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "design.md").read_text()
    ids = loaded.tokenizer(text)["input_ids"]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"only {len(ids)} tokens of text for a {args.prompt_tokens}-token prompt")
    prompt = ids[: args.prompt_tokens]
    others = [ids[1000 + 64 * i : 1000 + 64 * i + 48] for i in range(args.others)]
    contestants: dict[str, int | None] = {"chunked (default)": None, "one pass": args.prompt_tokens}
    chunk = engine.chain_limit()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in contestants}
    for r in range(args.rounds):
        for name, setting in (contestants.items() if r % 2 == 0 else reversed(contestants.items())):
            engine.prefill_chunk = setting
            run = one_round(engine, prompt, others, args.warm_s)
            run["alone_ttft_s"] = one_round(engine, prompt, [], 0.0)["ttft_s"]
            results[name].append(run)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items() if k != "timeline"), flush=True)
    keys = ("alone_ttft_s", "ttft_s", "stall_s", "others_tok_s")
    rows = [{"contestant": name, **{k: statistics.median(run[k] for run in runs) for k in keys}} for name, runs in results.items()]
    table = [f"{args.target} {args.dtype}, one thread on core {args.core}: a {args.prompt_tokens}-token prompt alone, and "
             f"arriving while {args.others} sessions decode (the target alone). Default chunk here: {chunk} tokens beside "
             f"others, {engine.chain_limit(alone=True)} alone. Medians of {args.rounds} rounds.",
             "", "| contestant | prompt alone: first token (s) | beside the others: first token (s) | others' longest wait "
             "for a token (s) | others' tok/s meanwhile |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    table += [f"| {r['contestant']} | {r['alone_ttft_s']:.2f} | {r['ttft_s']:.2f} | {r['stall_s']:.2f} | {r['others_tok_s']:.2f} |"
              for r in rows]  # fmt: skip
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join(table) + "\n")
        (args.out / "results.json").write_text(json.dumps({"chunk": chunk, "args": {k: str(v) for k, v in vars(args).items()},
                                                           "rows": rows, "rounds": results}, indent=1))  # fmt: skip
        plot(results, args.out / "timeline.png", args.others)


def plot(results: dict[str, list[dict[str, Any]]], path: Path, others: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for (name, runs), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        run = runs[0]
        times = [t for t in run["timeline"] if t >= 0]
        ax.step([0, *times], range(len(times) + 1), where="post", color=color, label=name)
        ax.axvline(run["ttft_s"], color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the long prompt arrived (dotted: its first token)")
    ax.set_ylabel(f"tokens of the other {others} sessions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
