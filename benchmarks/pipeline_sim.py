"""The pipelined split with the target played by its measured pass times: the real draft (llama.cpp,
its lookahead on or off) on one pinned core, and a target that accepts along its own greedy text and
sleeps for as long as its curve says the pass takes. With no target in the loop there is no target
noise, so planner and lookahead variants compare within a few percent (docs/benchmarks.md, "Both
nodes on llama.cpp"; docs/planner.md, "Passes cut to the sizes the target measured").

Variants: `auto` (`--budget auto` as it runs), `auto-old` (the planner on a curve at powers of two,
smoothed, without cutting trees to measured sizes: before 26 November), `chainK` (a fixed chain of K),
`alone` (the target alone);
a `-nola` suffix turns the lookahead off (the sequential split), an `-ebN` suffix sets auto's
expansion batch to N nodes a draft pass, `-nobackoff` keeps exploring drafts every 8 steps on
the target alone, `-nowarm` makes the first tree wait for the draft's prefill (the client runs the
target alone until a draft on its own machine has caught up: `Sequence._catch_up_apart`). The
target's first pass includes the prompt's rows.

`--target-curve FILE:LABEL` plays the target by a curve measured elsewhere instead of its own on
this core: `scripts/gpu_check.sh` writes curves.json with a target of Qwen2.5-7B's shape streamed
to a GPU. The text stays the real target's (acceptance is the default pair's), the time is the GPU's.
`--draft-curve FILE:LABEL` plays the draft's passes by a curve too (a draft on that GPU, as in the
paper's one-machine setup): the real draft still builds each tree, and a virtual clock charges each
of its passes the curve's time for its rows. Nothing overlaps then: every variant runs sequential.

`--draft-quantize int8` runs the home lab's int8 torch draft instead of the GGUF; `--trace FILE` writes
every drafted step and prints where the drafted steps' time went (`summarize`).

    python -m benchmarks.pipeline_sim --variants auto auto-old chain4 auto-nola --prompts 3
    python -m benchmarks.pipeline_sim --variants alone auto auto-nola --cap 128 \
        --target-curve "docs/gpu/h100-26nov-evening/curves.json:target 7b, 0 GPU layers"
    python -m benchmarks.pipeline_sim --draft-quantize int8 --variants auto auto-nola --cap 256 \
        --tokens 128 --target-curve curves.json:bf16 --trace trace.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_generation import PASSES, record_passes
from client.bench.harness import encode, load_prompts
from client.budget import BudgetPlanner
from client.generation import CATCH_UP, CATCH_UP_ALONE
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams, TreeStructure
from common.model.choices import QUANTIZE_CHOICES, draft_dtype
from common.model.llama_cpp import LlamaCppModel, load_gguf
from common.model.loading import load_model
from common.model.profiling import cached_forward_curve, interpolate
from common.model.store import resolve_gguf, resolve_model
from common.ops.hugepages import reexec_with_huge_pages
from draft_node.engine import DraftEngine
from target_node.llama_session import LlamaTargetSession

BUDGET = 64
def read_curve(spec: str) -> list[tuple[int, float]]:
    file, _, label = spec.partition(":")
    return [(int(n), float(t)) for n, t in json.loads(Path(file).read_text())[label]["curve"]]


def old_curve(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The curve as nodes measured it before 26 November: powers of two, smoothed non-decreasing."""
    points = [(n, t) for n, t in curve if n & (n - 1) == 0 or n == curve[-1][0]]
    seconds = [t for _, t in points]
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    return [(n, t) for (n, _), t in zip(points, seconds, strict=True)]


def greedy_text(model: LlamaCppModel, prompt: list[int], tokens: int) -> list[int]:
    """The target alone's greedy continuation, one root-only tree a step, as its node runs it."""
    session = LlamaTargetSession(model, prompt, max_context=2048, max_tree=BUDGET + 1, max_depth=16, eos_token_ids=())
    try:
        out: list[int] = []
        while len(out) < tokens:
            out += session.verify(TokenTree.root_only(session.committed[-1]), SamplingParams(), tokens - len(out)).tokens
        return out
    finally:
        session.close()


def planner_for(variant: str, target: list[tuple[int, float]], draft: list[tuple[int, float]]) -> BudgetPlanner | None:
    if not variant.startswith("auto"):
        return None
    if variant.startswith("auto-old"):  # its expansion batch, too, comes from the old draft curve
        return BudgetPlanner(old_curve(target), old_curve(draft), base=TreeParams(budget=BUDGET), fit_trees=False)
    plan = BudgetPlanner(target, draft, base=TreeParams(budget=BUDGET))
    if batch := re.search(r"-eb(\d+)", variant):
        plan.expand_batch = int(batch.group(1))
    plan.explore_backoff = "-nobackoff" not in variant
    return plan


def run(engine: DraftEngine, prompt: list[int], text: list[int], variant: str, target: list[tuple[int, float]],
        plan: BudgetPlanner | None, draft: list[tuple[int, float]] | None = None,
        trace: list[dict[str, float]] | None = None) -> dict[str, float]:  # fmt: skip
    """One generation of `text`; the target's pass is the measured time of its rows. Under auto a
    step the planner finds not worth drafting (`draft_pays`) runs the root alone, as the client
    does, and the draft catches up on its tokens at the next drafted step. With a `draft` curve,
    time is virtual: each pass of either model adds its curve's time, and nothing sleeps."""
    virtual = 0.0

    def spend(seconds: float) -> None:
        nonlocal virtual
        if draft is None:
            time.sleep(seconds)
        virtual += seconds

    def elapsed() -> float:
        return time.perf_counter() - start if draft is None else virtual

    request = plan.start() if plan is not None else None
    fixed = None if plan is not None or variant == "alone" else TreeParams.chain(int(variant.removeprefix("chain").split("-")[0]))  # fmt: skip
    measured = dict(target)
    sid = engine.open_session(prompt)
    done, unseen, steps, skipped, wait, reused = 0, [], 0, 0, 0.0, 0
    grown = engine.lookahead.forwards if engine.lookahead is not None else 0  # idle batches before this tree
    prefill, ttft = len(prompt), 0.0  # the target's first pass runs the prompt too
    cold = len(prompt)  # the draft's session runs its prompt at its first build
    catch_up: threading.Thread | None = None
    warm = draft is None and variant != "alone" and "-nowarm" not in variant
    start = time.perf_counter()
    while done < len(text) - 1:
        if warm and catch_up is None and cold + len(unseen) >= CATCH_UP_ALONE:
            catch_up = threading.Thread(target=engine.build_tree, args=(sid, unseen, CATCH_UP))
            catch_up.start()
            unseen, cold = [], 0
        if catch_up is not None and catch_up.is_alive():  # the target goes on alone meanwhile
            spend(interpolate(target, prefill + 1))
            unseen, done, steps, prefill = unseen + text[done : done + 1], done + 1, steps + 1, 0
            ttft = ttft or elapsed()
            continue
        catch_up = None
        params = plan.choose(request=request) if plan is not None else fixed
        if params is None or (plan is not None and not plan.draft_pays(request=request)):
            spend(interpolate(target, prefill + 1) if prefill else measured.get(1, target[0][1]))
            prefill = 0
            ttft = ttft or elapsed()
            unseen, done, steps, skipped = unseen + text[done : done + 1], done + 1, steps + 1, skipped + 1
            if plan is not None:
                plan.observe_alone(1, measured.get(1, target[0][1]), request=request)
            continue
        idle = engine.lookahead.forwards - grown if engine.lookahead is not None else 0  # since the last tree
        asked = time.perf_counter()
        PASSES.pop(id(engine.loaded.model), None)
        drafted = engine.build_tree(sid, unseen, params)
        grown = engine.lookahead.forwards if engine.lookahead is not None else 0
        cold = 0
        passes = PASSES.pop(id(engine.loaded.model), [])
        waited = time.perf_counter() - asked if draft is None else sum(interpolate(draft, n) for n in passes)
        if draft is not None:
            spend(waited)
        tree = plan.fit(drafted.tree, 0, request=request) if plan is not None else drafted.tree
        accepted = len(tree.walk(text[done:])) - 1
        unseen = text[done : done + accepted + 1]
        pass_seconds = interpolate(target, prefill + tree.size) if prefill else measured.get(tree.size, interpolate(target, tree.size))
        spend(pass_seconds)
        prefill = 0
        ttft = ttft or elapsed()
        if plan is not None and steps > 0:
            plan.observe(DraftedTree(tree, drafted.draft_forwards, reused=drafted.reused), unseen, waited,
                         pass_seconds, request=request)  # fmt: skip
        if trace is not None:
            depth = int(TreeStructure.from_parents(tree.parents).depths.max()) if tree.size > 1 else 0
            trace.append({"reused": drafted.reused, "forwards": drafted.draft_forwards, "wait": waited,
                          "idle_forwards": idle, "size": tree.size, "depth": depth, "tokens": len(unseen),
                          "min_prob": params.min_prob, "target": pass_seconds})  # fmt: skip
        wait, reused, steps, done = wait + waited, reused + drafted.reused, steps + 1, done + len(unseen)
    wall = elapsed()
    if catch_up is not None:
        catch_up.join()
    engine.close_session(sid)
    return {"tok_s": done / wall, "per_step": done / steps, "wait": wait / wall, "reused": reused / steps,
            "skipped": skipped / steps, "ttft": ttft}  # fmt: skip


def summarize(traces: list[dict[str, Any]], draft_one: float, deep: int = 8) -> None:
    """Where the drafted steps' time went: what a re-rooted tree and a fresh one cost the draft, the
    idle batches before each, and the steps whose trees reach `deep` levels, whose tokens a pipelined
    draft makes at most one a forward: their rate against 1 / (the draft's one-row pass)."""
    print(f"\n| category | variant | drafted steps | re-rooted | draft forwards, re-rooted / fresh | wait ms, "
          f"re-rooted / fresh | idle batches a step | steps {deep}+ deep | their tok/s | x 1/draft pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for t in traces:
        runs.setdefault((t["category"], t["variant"]), []).extend(t["steps"])
    for (category, variant), steps in sorted(runs.items()):
        if not steps:
            continue
        hit = [s for s in steps if s["reused"]]
        miss = [s for s in steps if not s["reused"]]
        long = [s for s in steps if s["depth"] >= deep]
        rate = sum(s["tokens"] for s in long) / sum(s["wait"] + s["target"] for s in long) if long else 0.0
        print(f"| {category} | {variant} | {len(steps)} | {len(hit) / len(steps):.0%} | {_mean(hit, 'forwards')} / "
              f"{_mean(miss, 'forwards')} | {_mean(hit, 'wait', 1000, 0)} / {_mean(miss, 'wait', 1000, 0)} "
              f"| {_mean(steps, 'idle_forwards')} | {len(long)} | {rate:.1f} | {rate * draft_one:.2f} |")


def _mean(rows: list[dict[str, float]], key: str, scale: float = 1.0, digits: int = 1) -> str:
    return f"{scale * sum(r[key] for r in rows) / len(rows):.{digits}f}" if rows else "-"


def main() -> None:
    global BUDGET
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="an installed GGUF's name, or a path")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="an installed GGUF's name, or a path")
    ap.add_argument("--variants", nargs="+", default=["auto", "auto-old", "auto-nola"])
    ap.add_argument("--prompts", type=int, default=2, help="per category (code, prose)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--draft-core", type=int, default=0)
    ap.add_argument("--target-core", type=int, default=1, help="where the target's curve and text are computed")
    ap.add_argument("--target-curve", metavar="FILE:LABEL", help="play the target by this curve (gpu_check.sh's curves.json)")
    ap.add_argument("--draft-curve", metavar="FILE:LABEL", help="play the draft's passes by this curve (virtual time)")
    ap.add_argument("--target-scale", type=float, default=1.0,
                    help="multiply the target's curve: 10 makes the 7B shape's stream a 70B-class one's")
    ap.add_argument("--draft-quantize", choices=QUANTIZE_CHOICES, nargs="+",
                    help="run the draft on torch with this quantization (the home lab's int8 draft) instead of "
                         "llama.cpp; several: each variant runs with each draft, interleaved, as 'variant int4'")
    ap.add_argument("--trace", metavar="FILE", help="write every drafted step's tree, wait and idle batches as JSON")
    ap.add_argument("--cap", type=int, default=BUDGET, help="the largest tree, as `--auto-cap` (at most 255)")
    args = ap.parse_args()
    BUDGET = args.cap
    torch.set_num_threads(1)
    paths = {name: resolve_gguf(name) or name for name in (args.draft, args.target)}
    os.sched_setaffinity(0, {args.target_core})
    target = load_gguf(str(paths[args.target]), threads=1)
    if args.target_curve:
        target_curve = [(n, t * args.target_scale) for n, t in read_curve(args.target_curve)]
    else:
        target_curve, _ = cached_forward_curve(target.model, BUDGET + 1, 1.0, target.path)
    prompts = load_prompts(None, None, ("code", "prose"))
    by = {c: [q for q in prompts if q["category"] == c][: args.prompts] for c in ("code", "prose")}
    picks = [p for pair in zip(by["code"], by["prose"], strict=True) for p in pair]  # alternating, as a bench runs
    texts = [(p["category"], encode(target.tokenizer, p["prompt"])) for p in picks]
    texts = [(c, ids, greedy_text(target.model, ids, args.tokens + 1)) for c, ids in texts]
    target.model.close()
    os.sched_setaffinity(0, {args.draft_core})
    schemes = args.draft_quantize or [None]
    drafts = {}
    for scheme in schemes:
        if scheme:
            draft = load_model(resolve_model(args.draft), dtype=draft_dtype("bfloat16", scheme), quantize=scheme)
        else:
            draft = load_gguf(str(paths[args.draft]), threads=1)
        if args.draft_curve:
            draft_curve = read_curve(args.draft_curve)
            record_passes()
        else:
            draft_curve, _ = cached_forward_curve(draft.model, BUDGET, 1.0, draft.path)
        engines = {la: DraftEngine(draft, lookahead=la, max_context=2048, max_tree=BUDGET, max_sessions=4) for la in (True, False)}
        for engine in engines.values():
            if engine.lookahead is not None:
                engine.lookahead.alone_seconds = 0.0  # one session at a time, each new
        drafts[scheme] = (engines, draft_curve)
    label = {(v, q): v if len(schemes) == 1 else f"{v} {q}" for v in args.variants for q in schemes}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    traces: list[dict[str, object]] = []
    try:
        # One planner per variant for all its prompts, as a client keeps one: a request starts from
        # what the ones before it learned.
        plans = {(v, q): planner_for(v, target_curve, drafts[q][1]) for v in args.variants for q in schemes}
        for category, ids, text in texts:  # variants interleaved prompt by prompt
            for variant in args.variants:
                for scheme in schemes:
                    engines, draft_curve = drafts[scheme]
                    lookahead = "-nola" not in variant and not args.draft_curve
                    played = draft_curve if args.draft_curve else None
                    steps: list[dict[str, float]] = []
                    r = run(engines[lookahead], ids, text, variant, target_curve, plans[variant, scheme], played, steps)
                    traces.append({"category": category, "variant": label[variant, scheme], "steps": steps})
                    results.setdefault((category, label[variant, scheme]), []).append(r)
    finally:
        for engines, _ in drafts.values():
            for engine in engines.values():
                engine.close()
    played = f"the curve '{args.target_curve}'" if args.target_curve else "its curve"
    played += f" x{args.target_scale:g}" if args.target_scale != 1 else ""
    drafting = f"played by the curve '{args.draft_curve}' (virtual time, no lookahead)" if args.draft_curve else f"on core {args.draft_core}"
    print(f"draft {args.draft} {drafting}, target {args.target} played by {played}, "
          f"{args.tokens} greedy tokens, {args.prompts} prompts per category")  # fmt: skip
    print("| category | variant | tok/s (geomean) | tokens/step | draft wait | re-rooted | target alone | first token |")
    print("|---|---|---|---|---|---|---|---|")
    for (category, variant), rs in sorted(results.items()):
        geo = math.exp(sum(math.log(r["tok_s"]) for r in rs) / len(rs))
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("per_step", "wait", "reused", "skipped", "ttft")}
        print(f"| {category} | {variant} | {geo:.2f} | {mean['per_step']:.2f} | {mean['wait']:.0%} | {mean['reused']:.0%} "
              f"| {mean['skipped']:.0%} | {mean['ttft']:.2f} s |")  # fmt: skip
    if args.trace:
        Path(args.trace).write_text(json.dumps(traces))
        summarize(traces, interpolate(drafts[schemes[0]][1], 1))


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
