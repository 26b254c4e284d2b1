"""Two settings of the nodes' flags under load, interleaved: the load bench's lab (`client.bench.load`,
nodes pinned apart, gateway and clients on the draft's core) with one contestant per setting, rounds
of N concurrent streaming chat clients taking turns. Prints per round each setting's aggregate
tok/s, sessions per target and draft pass, and its clients' tok/s; then the mean per setting.

    .venv/bin/python -m benchmarks.load_flags_lab --draft-a="--batch-regroup-ms 0" --draft-b="--batch-regroup-ms 10"
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import time
from pathlib import Path

from client.bench import load
from client.bench.harness import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for side in ("a", "b"):
        parser.add_argument(f"--target-{side}", default="", help=f"setting {side}: the target node's extra flags")
        parser.add_argument(f"--draft-{side}", default="", help=f"setting {side}: the draft node's extra flags")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 8, 1, 8, 8], help="one round per entry")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-quantize", default="int8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    load.CONTESTANTS = {
        f"{side}: {getattr(args, f'target_{side}')} | {getattr(args, f'draft_{side}')}": (
            shlex.split(getattr(args, f"target_{side}")),
            shlex.split(getattr(args, f"draft_{side}")),
        )
        for side in ("a", "b")
    }
    config = load.LoadConfig(dtype=args.dtype, draft_quantize=args.draft_quantize, clients=tuple(args.clients),
                             max_new_tokens=args.max_new_tokens, out=Path("/dev/null"))  # fmt: skip
    os.sched_setaffinity(0, set(config.draft_cores))
    prompts = [p["prompt"] for p in load_prompts(None, None, ("chat",))]
    lab = load.LoadLab(config)
    speeds: dict[tuple[str, int], list[float]] = {}
    try:
        for url in lab.urls.values():  # untimed: first-call costs stay out of the figures
            load.stream_chat(url, prompts[0], 4)
        for n in args.clients:
            for name, url in lab.urls.items():
                time.sleep(1.5)  # the last round's lookahead settles
                before = lab.counters(name)
                runs, wall = load.round_of(url, name, n, prompts, args.max_new_tokens)
                after = {k: v - before[k] for k, v in lab.counters(name).items()}
                rate = sum(r.tokens for r in runs) / wall
                speeds.setdefault((name, n), []).append(rate)
                print(f"{name}: {n} clients: {rate:.2f} tok/s, "
                      f"{after['target_sum'] / max(after['target_count'], 1):.2f} sessions per target pass, "
                      f"{after['draft_sum'] / max(after['draft_count'], 1):.2f} per draft pass "
                      f"({after['draft_count']:.0f} passes), clients' tok/s "
                      f"{sorted(round(r.tokens / r.seconds, 2) for r in runs)}", flush=True)  # fmt: skip
    finally:
        lab.close()
    for (name, n), rates in sorted(speeds.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"mean, {n} clients, {name}: {statistics.mean(rates):.2f} tok/s over {len(rates)} rounds")


if __name__ == "__main__":
    main()
