"""A burst of new prompts on a target that is already streaming: one chunk of prompt rows a pass over
all sessions (`prompt_chunks`, as shipped) against a chunk per session (the rule before).

One target engine in this process (the default pair's target, on llama.cpp by default, one thread, as
on the home lab's target core). A session streams the target alone (a Decode call of `--stream` tokens); meanwhile K new chat
prompts arrive at once, each running a Decode call of `--answer` tokens. Rounds alternate the two
rules. Reports each rule's time to first token over the burst (p50, p95), the burst's whole time, and
the streaming session's longest gap between two tokens (how long the burst stalled it), as a
markdown table; the tokens are checked equal between the rules.

    python -m benchmarks.prompt_budget --out docs/prompt-budget.md
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from pathlib import Path

import torch

from client.api import render_chat
from client.bench.harness import load_prompts
from common.decoding.sampling import SamplingParams
from common.model.llama_cpp import load_gguf, tree_limit
from common.model.loading import load_model
from common.model.store import resolve_model
from target_node.engine import TargetEngine

RULES = {"one chunk a pass (shipped)": True, "a chunk per session (before)": False}


def burst(engine: TargetEngine, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, object]:
    stream_prompt = prompts[-1]
    sid = engine.open_session(stream_prompt)
    list(engine.decode(sid, stream_prompt[-1], SamplingParams(max_new_tokens=4), 4, steps=4))  # prefilled
    times: list[float] = []
    stop = threading.Event()
    params = SamplingParams(max_new_tokens=args.stream)

    def streaming() -> None:
        last = engine.sessions.get(sid).committed[-1]
        for result in engine.decode(sid, last, params, args.stream, steps=args.stream):
            times.append(time.perf_counter())
            if stop.is_set() or not result.tokens:
                break

    firsts: dict[int, float] = {}
    outputs: dict[int, list[int]] = {}

    def request(i: int, start: float) -> None:
        rid = engine.open_session(prompts[i])
        tokens: list[int] = []
        answer = SamplingParams(max_new_tokens=args.answer)
        for result in engine.decode(rid, prompts[i][-1], answer, args.answer, steps=args.answer):
            if not tokens:
                firsts[i] = time.perf_counter() - start
            tokens += result.tokens
        outputs[i] = tokens
        engine.close_session(rid)

    streamer = threading.Thread(target=streaming)
    streamer.start()
    time.sleep(1.0)  # streaming steadily
    start = time.perf_counter()
    threads = [threading.Thread(target=request, args=(i, start)) for i in range(args.burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    whole = time.perf_counter() - start
    stop.set()
    streamer.join()
    engine.close_session(sid)
    during = [b - a for a, b in itertools.pairwise(times) if b > start and a < start + whole]
    ttft = sorted(firsts.values())
    return {"ttft_p50": statistics.median(ttft), "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "whole": whole, "stall": max(during, default=0.0), "outputs": [outputs[i] for i in sorted(outputs)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--backend", choices=("torch", "llama.cpp"), default="llama.cpp",
                        help="llama.cpp: the model's GGUF (`specexec models install M --format gguf`), whose CPU "
                        "passes cost nearly their rows; torch bf16 is flat on an AMX CPU, where the rules agree")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", help="torch only")
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--answer", type=int, default=8, help="tokens each new request decodes")
    parser.add_argument("--stream", type=int, default=400, help="the streaming session's tokens at most")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per rule, alternating")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sessions = args.burst + 2
    if args.backend == "llama.cpp":
        loaded = load_gguf(args.model, threads=1)
        tree = tree_limit(sessions)
    else:
        loaded, tree = load_model(resolve_model(args.model), dtype=args.dtype), 1024
    engine = TargetEngine(loaded, max_context=1024, max_tree=tree, max_sessions=sessions)  # a node's default tree
    engine.profile()
    prompts = [render_chat(loaded.tokenizer, [{"role": "user", "content": p["prompt"]}])
               for p in load_prompts(None, None, ("chat",))][: args.burst + 1]  # fmt: skip
    rows: dict[str, list[dict[str, object]]] = {name: [] for name in RULES}
    order = list(RULES)
    burst(engine, prompts, args)  # untimed: first-call costs
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            engine.prompt_budget = RULES[name]
            rows[name].append(burst(engine, prompts, args))
            got = rows[name][-1]
            print(f"round {r + 1}, {name}: TTFT p50 {got['ttft_p50']:.2f} s, p95 {got['ttft_p95']:.2f} s, "
                  f"burst {got['whole']:.2f} s, stream stalled {got['stall']:.2f} s", flush=True)  # fmt: skip
    same = all(x["outputs"] == rows[order[0]][0]["outputs"] for runs in rows.values() for x in runs)
    lengths = sorted(len(p) - 1 for p in prompts[: args.burst])
    lines = [
        f"# A burst of {args.burst} new prompts beside a streaming session\n",
        f"{args.model} ({args.backend if args.backend == 'llama.cpp' else args.dtype}), one thread, curve-sized chunk {engine.chain_limit()} rows; prompts of "
        f"{lengths[0]}-{lengths[-1]} pending rows ({sum(lengths)} in all), each then {args.answer} tokens on the "
        f"target alone; {args.rounds} rounds per rule, alternating. Same tokens under both rules: {same}.\n",
        "| rule | TTFT p50 s | TTFT p95 s | burst s | streaming session's longest gap s |",
        "|---|---|---|---|---|",
    ]
    for name, runs in rows.items():
        mean = {k: statistics.mean(float(x[k]) for x in runs) for k in ("ttft_p50", "ttft_p95", "whole", "stall")}  # type: ignore[arg-type]
        lines.append(f"| {name} | {mean['ttft_p50']:.2f} | {mean['ttft_p95']:.2f} | {mean['whole']:.2f} | "
                     f"{mean['stall']:.2f} |")  # fmt: skip
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
