"""Many sessions on one target at a real model's scale: what a shared pass buys where a pass costs
about the same for 1 row as for 100 (a target streamed from RAM to a GPU, the paper's regime).

`specexec bench --load` measures the real pair through the gateway on a CPU; on a GPU machine no
checkpoint can be reached, so here the models are random Q4_K GGUFs of real shapes
(`benchmarks/bench_offload.py --write-gguf`: a pass costs what a real file's does) and the sessions
are threads of one process, each a `Sequence` on the same `TargetEngine` (and `DraftEngine`), as the
nodes run them: the engines' batchers put the work of every session waiting into one pass, and the
target's waits for sessions due back where its forward-time curve says that pays
(common.runtime.batching). Contestants, each with engines of its own: "batched", "batched, waiting
for none away" (`SPECEXEC_WAIT_DUE=0`: before 27 November) and "one session per pass"
(`max_batch_tokens=1`: each session's step runs alone, one after another). The target's curve is
measured at start, or read from an earlier `scripts/gpu_check.sh` run's curves.json. Random weights tie every logit, so what a tree
accepts means nothing: the runs are counted in steps (a step of the target alone is one token; a
drafted step is one target pass for the session, whatever it would accept with real weights).

    python -m benchmarks.bench_offload --shape qwen2.5-7b --write-gguf /tmp/7b.gguf
    python -m benchmarks.bench_offload --shape qwen2.5-0.5b --write-gguf /tmp/0.5b.gguf
    python -m benchmarks.gpu_load --target /tmp/7b.gguf --draft /tmp/0.5b.gguf --draft-layers 99
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_generation import PASSES, loaded, record_passes
from client.generation import GenerationStats, Sequence
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.loaded import LoadedModel
from common.model.profiling import forward_curve
from common.ops.hugepages import reexec_with_huge_pages
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

# name -> the engines' options, and whether the target's passes wait for sessions due back
CONTESTANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "batched": ({}, True),
    "batched, waiting for none away": ({}, False),
    "one session per pass": ({"max_batch_tokens": 1}, False),
}


def session(target: TargetEngine, draft: DraftEngine | None, tree: TreeParams | None, prompt: list[int],
            steps: int, start: threading.Barrier, steady: threading.Barrier, out: dict[str, float]) -> None:  # fmt: skip
    """One client: `steps` greedy steps after the prompt; its first step's and its last's times. The
    clients wait for each other after their first step, so that the rates are the steady state's."""
    start.wait()
    began = time.perf_counter()
    seq = None
    try:
        seq = Sequence(target, draft, prompt)
        done = 0
        for _ in seq.steps(SamplingParams(max_new_tokens=10**6, ignore_eos=True), tree, GenerationStats()):
            done += 1
            if done == 1:
                out["ttft"] = time.perf_counter() - began
                steady.wait()
                out["first"] = time.perf_counter()
            if done == steps:
                break
        out["end"] = time.perf_counter()
        out["steps"] = done
        turnaround = target.batcher.turnaround(seq.target_session)
        if turnaround is not None:
            out["turnaround"] = turnaround
    except BaseException:
        steady.abort()  # the others must not wait for this one's first step
        raise
    finally:
        if seq is not None:
            seq.close()


def round_(target: TargetEngine, draft: DraftEngine | None, tree: TreeParams | None, clients: int,
           steps: int, prompt_tokens: int) -> dict[str, Any]:  # fmt: skip
    """`clients` sessions started together; their rates and the target's passes after the first step
    (the prompts' prefill is in the time to first step)."""
    prompts = [[(7 * i + 11 * c + 3) % 1000 for i in range(prompt_tokens)] for c in range(clients)]
    models = [id(target.loaded.model)] + ([id(draft.loaded.model)] if draft is not None else [])

    def forget() -> None:
        for m in models:
            PASSES.pop(m, None)

    start, steady = threading.Barrier(clients, action=forget), threading.Barrier(clients, action=forget)
    outs: list[dict[str, float]] = [{} for _ in range(clients)]
    threads = [threading.Thread(target=session, args=(target, draft, tree, p, steps, start, steady, o))
               for p, o in zip(prompts, outs, strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("end" not in o for o in outs):
        raise RuntimeError("a session failed (see the tracebacks above)")
    passes = PASSES.pop(models[0], [])
    drafts = PASSES.pop(models[-1], []) if draft is not None else []
    first, end = min(o["first"] for o in outs), max(o["end"] for o in outs)
    rates = sorted((o["steps"] - 1) / (o["end"] - o["first"]) for o in outs)
    ttfts = sorted(o["ttft"] for o in outs)
    turnarounds = [o["turnaround"] for o in outs if "turnaround" in o]
    return {"clients": clients, "aggregate": sum(o["steps"] - 1 for o in outs) / (end - first),
            "rates": rates, "ttft": ttfts, "passes": len(passes), "rows": sum(passes),
            "steps": sum(o["steps"] - 1 for o in outs), "draft_passes": len(drafts),
            "turnaround": statistics.median(turnarounds) if turnarounds else None,
            "return_spread": target.batcher.return_spread}  # fmt: skip


def engines(models: dict[str, LoadedModel], contestant: str, curve: list[tuple[int, float]], cap: int,
            clients: int, context: int) -> tuple[TargetEngine, DraftEngine]:  # fmt: skip
    options, waits = CONTESTANTS[contestant]
    limits = {"max_context": context, "max_sessions": clients, **options}
    target = TargetEngine(models["target"], max_tree=cap + 1, **limits)
    target.use_curve(curve)
    if not waits:
        target.batcher.cost = None
    return target, DraftEngine(models["draft"], max_tree=cap, **limits)


CLIENT_TICKS = [1, 2, 4, 8]


def plot(runs: list[dict[str, Any]], png: Path, title: str) -> None:
    """Aggregate steps/s and the median client's share of its rate alone, against clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (total, share) = plt.subplots(1, 2, figsize=(11, 4.2))
    alone = {r["tree"]: statistics.median(r["rates"]) for r in runs if r["clients"] == 1}
    styles = {name: style for name, style in zip(CONTESTANTS, ("-", "--", ":"), strict=True)}
    for i, tree in enumerate(sorted(alone)):
        for name in CONTESTANTS:
            rows = sorted((r for r in runs if r["tree"] == tree and (r["contestant"] == name or r["clients"] == 1)),
                          key=lambda r: r["clients"])  # fmt: skip
            if len(rows) < 2:
                continue
            label = f"{'tree of ' + str(tree) if tree else 'target alone'}, {name}"
            clients = [r["clients"] for r in rows]
            total.plot(clients, [r["aggregate"] for r in rows], styles[name], color=f"C{i}", marker="o", label=label)
            share.plot(clients, [statistics.median(r["rates"]) / alone[tree] for r in rows], styles[name],
                       color=f"C{i}", marker="o")  # fmt: skip
    for ax, ylabel in ((total, "steps/s, all clients"), (share, "median client's steps/s over its rate alone")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(CLIENT_TICKS, [str(c) for c in CLIENT_TICKS])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    share.axhline(0.5, color="grey", lw=0.8)
    total.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--target-layers", type=int, default=0, help="the target's --n-gpu-layers")
    ap.add_argument("--draft-layers", type=int, default=99, help="the draft's --n-gpu-layers")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8], help="1 among them: the rate alone")
    ap.add_argument("--trees", type=int, nargs="*", default=[16], help="fixed tree budgets to run beside the target alone")
    ap.add_argument("--steps", type=int, default=24, help="each session's steps after its first")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--contestants", nargs="+", choices=list(CONTESTANTS), default=list(CONTESTANTS))
    ap.add_argument("--curves-from", type=Path, help="curves.json of an earlier scripts/gpu_check.sh run")
    ap.add_argument("--target-curve", help="the target's curve's label in --curves-from")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, metavar="JSON", help="plot an earlier --out to --png, and exit")
    ap.add_argument("--png", type=Path, default=Path("gpu-load.png"))
    ap.add_argument("--title", default="many sessions on one target")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.png, args.title)
        return
    if 1 not in args.clients:
        ap.error("--clients needs 1 among them: each client's rate is set against its rate alone")
    if args.target is None or args.draft is None:
        ap.error("--target and --draft are required, unless --plot")
    record_passes()
    models = {"target": loaded(args.target, args.target_layers), "draft": loaded(args.draft, args.draft_layers)}
    cap = max(args.trees, default=1)
    if args.curves_from:
        curve = [tuple(p) for p in json.loads(args.curves_from.read_text())[args.target_curve]["curve"]]
    else:
        curve = forward_curve(models["target"].model, cap + 1, 1.0, progress=False)
    print("target curve: " + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in curve if n & (n - 1) == 0))
    runs: list[dict[str, Any]] = []
    for name in args.contestants:
        target, draft = engines(models, name, curve, cap, max(args.clients), args.context)
        for budget in [None, *args.trees]:
            for clients in args.clients:
                if name != args.contestants[0] and clients == 1:
                    continue  # one session alone runs the same passes either way
                tree = TreeParams(budget=budget) if budget else None
                r = round_(target, draft if budget else None, tree, clients, args.steps + 1, args.prompt_tokens)
                runs.append({"contestant": name, "tree": budget or 0, **r})
                print(f"{name}, {'tree of ' + str(budget) if budget else 'target alone'}, {clients} clients: "
                      f"{r['aggregate']:.1f} steps/s", flush=True)  # fmt: skip
        target.close()
        draft.close()
    print(f"\ntarget {args.target.name} ({args.target_layers} GPU layers), draft {args.draft.name} "
          f"({args.draft_layers} GPU layers), {args.steps} steps a session after a {args.prompt_tokens}-token prompt")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    print("| contestant | run | clients | steps/s, all | a client's steps/s: p50 | min | p50 over alone | "
          "first step p50 / p95 (s) | target passes | sessions a pass | rows a pass | draft passes | turnaround p50 (ms) "
          "| return spread (ms a session) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    alone = {r["tree"]: statistics.median(r["rates"]) for r in runs if r["clients"] == 1}
    for r in runs:
        p50 = statistics.median(r["rates"])
        ttft = r["ttft"]
        p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
        run = f"tree of {r['tree']}" if r["tree"] else "target alone"
        turnaround = "" if r.get("turnaround") is None else f"{r['turnaround'] * 1e3:.1f}"
        spread = "" if r.get("return_spread") is None else f"{r['return_spread'] * 1e3:.1f}"
        print(f"| {r['contestant']} | {run} | {r['clients']} | {r['aggregate']:.2f} | {p50:.2f} | {r['rates'][0]:.2f} "
              f"| {p50 / alone[r['tree']]:.2f}x | {statistics.median(ttft):.2f} / {p95:.2f} | {r['passes']} "
              f"| {r['steps'] / max(r['passes'], 1):.2f} | {r['rows'] / max(r['passes'], 1):.1f} | {r['draft_passes']} "
              f"| {turnaround} | {spread} |")  # fmt: skip


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
