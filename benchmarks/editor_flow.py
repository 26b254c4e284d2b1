"""Code completion as an editor plugin asks for it (llama.vscode's `/infill`), SpecExec against the
target alone, in the home lab.

A user works down a source file: at each stop the cursor sits a few characters into a line, and the
plugin asks for the rest (greedy, `n_predict` tokens), sending up to 256 lines before the cursor, 16
after and a chunk of another file, as llama.vscode does; before a file's first request it warms the
cache with the context alone (`n_predict` 0). Consecutive requests share the file up to the earlier
cursor, so the nodes read only the lines in between and the suffix. A target node (core 1) and a
draft node (core 0) serve two gateways with prompt caches: `--budget auto` and `--mode
autoregressive` (the target alone), asked in turn, one request each at every stop. Reports each
request's latency, the prompt tokens the target held (`timings.cache_n`) and whether both texts
agree, per file and overall (geometric means), as markdown.

    python -m benchmarks.editor_flow --backend llama.cpp --draft-backend torch --out docs/editor-flow/report.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from client.bench.gateway_lab import add_pair_args, start_gateway, start_nodes
from client.bench.harness import stop_processes

ROOT = Path(__file__).resolve().parent.parent
FILES = ("client/prompt_cache.py", "common/decoding/tree.py", "client/text.py")
EXTRA = "client/infill.py"  # the other file a plugin sends a chunk of
CONTESTANTS = {"specexec": ["--budget", "auto"], "target alone": ["--mode", "autoregressive"]}


def infill(url: str, body: dict) -> tuple[dict, float]:
    request = urllib.request.Request(url + "/infill", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        out = json.loads(answer.read())
    return out, time.perf_counter() - started


def stops(lines: list[str], count: int, typed: int) -> list[tuple[str, str, str]]:
    """(prefix, typed part of the line, suffix) at `count` lines spread down the file's second half
    that have code to complete: the user has typed `typed` characters of each."""
    code = [i for i in range(len(lines) // 2, len(lines)) if len(lines[i].strip()) > typed + 8]
    picked = [code[round(k * (len(code) - 1) / max(count - 1, 1))] for k in range(count)]
    out = []
    for i in picked:
        indent = len(lines[i]) - len(lines[i].lstrip())
        cut = indent + typed
        out.append(("".join(lines[max(0, i - 256) : i]), lines[i][:cut], lines[i][cut:] + "".join(lines[i + 1 : i + 17])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(parser)
    parser.add_argument("--stops", type=int, default=6, help="completions asked down each file")
    parser.add_argument("--typed", type=int, default=4, help="characters of the line typed before each")
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    extra = [{"filename": EXTRA, "text": "".join((ROOT / EXTRA).read_text().splitlines(True)[:64])}]
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        addrs = start_nodes(args, [], procs)
        urls = {name: start_gateway(addrs, flags, procs) for name, flags in CONTESTANTS.items()}
        for url in urls.values():  # untimed: first-call costs stay out of the figures
            infill(url, {"input_prefix": "x = 1\n", "input_suffix": "", "n_predict": 4})
        for f, path in enumerate(FILES):
            order = list(urls) if f % 2 == 0 else list(reversed(urls))
            lines = (ROOT / path).read_text().splitlines(True)
            for name in order:  # the plugin's warm-up: the context alone
                infill(urls[name], {"input_prefix": "", "input_suffix": "", "input_extra": extra, "n_predict": 0})
            for k, (before, typed, after) in enumerate(stops(lines, args.stops, args.typed)):
                body = {"input_prefix": before, "prompt": typed, "input_suffix": after, "input_extra": extra,
                        "n_predict": args.n_predict, "temperature": 0, "cache_prompt": True}  # fmt: skip
                got = {}
                for name in order:
                    out, seconds = infill(urls[name], body)
                    got[name] = out
                    rows.append({"file": path, "stop": k + 1, "contestant": name, "seconds": seconds,
                                 "prompt": out["tokens_evaluated"], "cached": out["timings"]["cache_n"],
                                 "tokens": out["tokens_predicted"], "text": out["content"]})  # fmt: skip
                    print(f"{path} stop {k + 1} {name}: {seconds:.2f} s, {out['tokens_predicted']} tokens, prompt "
                          f"{out['tokens_evaluated']} ({out['timings']['cache_n']} held)", flush=True)  # fmt: skip
    finally:
        stop_processes(procs)
    report = table(rows, args)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


def table(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(r["file"], r["stop"], r["contestant"]): r for r in rows}
    lines = [f"`python -m benchmarks.editor_flow --backend {args.backend} --draft-backend {args.draft_backend or args.backend} "
             f"--draft-quantize {args.draft_quantize} --stops {args.stops} --typed {args.typed} --n-predict {args.n_predict}`\n",
             "| file | stop | prompt tokens | held (SpecExec / alone) | tokens | SpecExec (s) | target alone (s) | x | same text |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ratios: dict[str, list[float]] = {}
    for (path, stop, name), spec in by.items():
        if name != "specexec":
            continue
        alone = by[(path, stop, "target alone")]
        ratio = alone["seconds"] / spec["seconds"]
        ratios.setdefault(path, []).append(ratio)
        lines.append(f"| {path} | {stop} | {spec['prompt']} | {spec['cached']} / {alone['cached']} | {spec['tokens']} "
                     f"| {spec['seconds']:.2f} | {alone['seconds']:.2f} | {ratio:.2f} "
                     f"| {'yes' if spec['text'] == alone['text'] else 'no'} |")  # fmt: skip
    lines.append("\n| file | SpecExec's speed-up, geometric mean | range |\n|---|---|---|")
    for path, values in ratios.items():
        lines.append(f"| {path} | {statistics.geometric_mean(values):.2f}x | {min(values):.2f}-{max(values):.2f} |")
    every = [v for values in ratios.values() for v in values]
    lines.append(f"| all | {statistics.geometric_mean(every):.2f}x | {min(every):.2f}-{max(every):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
