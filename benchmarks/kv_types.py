"""What a quantized KV cache (`--kv-type q8_0` / `q4_0`) costs a llama.cpp pass, and what it saves.

One GGUF, a context per KV type, each holding the same `--prefix` tokens; then tree passes of k
rows (as chains: a tree differs only in its mask) after them, the types interleaved pass by pass,
minimum over repeats. Also each context's state bytes for the prefix (the KV it holds). The
quantized types turn on flash attention, which llama.cpp needs for a quantized V.

    .venv/bin/python -m benchmarks.kv_types --out docs/kv-types.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.model.llama_cpp import LlamaCppModel
from common.model.store import resolve_gguf

TYPES = ("f16", "q8_0", "q4_0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    path = resolve_gguf(args.gguf)
    if path is None:
        raise SystemExit(f"no GGUF for {args.gguf!r}: specexec models install {args.gguf} --format gguf")
    if path.is_dir():
        path = next(path.glob("*.gguf"))
    lanes, sizes = {}, {}
    for kv in TYPES:
        model = LlamaCppModel(path, kv_type=kv, threads=args.threads)
        ctx = model.context(args.prefix + max(args.rows) + 8, max_rows=max(args.rows))
        lane = ctx.lane(args.prefix + max(args.rows) + 8, max(args.rows) - 1)
        lane.extend([int(t) for t in np.random.default_rng(0).integers(100, 20000, args.prefix)])
        lanes[kv], sizes[kv] = (model, ctx, lane), model.lib.llama_state_get_size(ctx._ctx)
    times: dict[tuple[str, int], list[float]] = {(kv, k): [] for kv in TYPES for k in args.rows}
    for _ in tqdm(range(args.repeats + 1), desc="rounds"):
        for k in args.rows:
            tokens, parents = np.arange(500, 500 + k), np.arange(-1, k - 1)
            for kv in TYPES:
                lane = lanes[kv][2]
                started = time.perf_counter()
                lane.tree(tokens, parents)
                times[(kv, k)].append(time.perf_counter() - started)
                lane.drop_tree()
    lines = [f"# A quantized KV cache on llama.cpp: {path.name}, {args.prefix} tokens held", "",
             f"`python -m benchmarks.kv_types` ({args.repeats} rounds after a warm-up, types interleaved; "
             "minimum ms a pass of k rows after the held tokens).", "",
             "| KV type | state bytes held | x f16 | " + " | ".join(f"{k} rows ms" for k in args.rows) + " |",
             "|---|---|---|" + "---|" * len(args.rows)]  # fmt: skip
    for kv in TYPES:
        cells = [f"{min(times[(kv, k)][1:]) * 1e3:.1f}" for k in args.rows]
        lines.append(f"| {kv} | {sizes[kv]:,} | {sizes[kv] / sizes['f16']:.2f} | " + " | ".join(cells) + " |")
    for kv in TYPES[1:]:
        ratio = statistics.geometric_mean(min(times[(kv, k)][1:]) / min(times[("f16", k)][1:]) for k in args.rows)
        lines.append(f"\n{kv}: a pass takes {ratio:.2f}x f16's (geometric mean over the row counts).")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
