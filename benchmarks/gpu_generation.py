"""Whole generations at a real model's scale, each step timed against the forward-time curves that
predict it: does a step cost what its passes cost, or does the loop around them (the draft's search,
the acceptance walk over every node's logits, Python) add a share that the curves miss?

On a GPU machine no checkpoint can be reached, so the models are random Q4_K GGUFs of real shapes
(`benchmarks/bench_offload.py --write-gguf`: a pass costs what a real file's does). Random weights tie
every logit, so what a tree accepts means nothing here; the times do. Fixed trees (`--budgets`) and
the target alone run in one process, as `specexec generate --target-model T --draft-model D
--n-gpu-layers N --draft-n-gpu-layers M` runs them; the draft's pass sizes are recorded so that its
predicted time is the sum of its curve over its own passes. `benchmarks/pipeline_sim.py
--target-curve/--draft-curve` plays the default pair's acceptance on such curves.

    python -m benchmarks.bench_offload --shape qwen2.5-7b --write-gguf /tmp/7b.gguf
    python -m benchmarks.bench_offload --shape qwen2.5-0.5b --write-gguf /tmp/0.5b.gguf
    python -m benchmarks.gpu_generation --target /tmp/7b.gguf --draft /tmp/0.5b.gguf --draft-layers 99
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from client.generation import GenerationStats, Sequence
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.llama_cpp import LlamaContext, LlamaCppModel
from common.model.loaded import LoadedModel
from common.model.profiling import forward_curve, interpolate
from common.ops.hugepages import reexec_with_huge_pages
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

PASSES: dict[int, list[int]] = {}  # id(model) -> the sizes of its passes since last cleared


def record_passes() -> None:
    decode = LlamaContext._decode

    def recorded(self: LlamaContext, n: int, *args: Any, **kwargs: Any) -> None:
        PASSES.setdefault(id(self.model), []).append(n)
        decode(self, n, *args, **kwargs)

    LlamaContext._decode = recorded  # type: ignore[method-assign]


def loaded(path: Path, layers: int, threads: int | None = None) -> LoadedModel:
    model = LlamaCppModel(path, n_gpu_layers=layers, threads=threads)
    return LoadedModel(model=model, tokenizer=None, name=path.stem, eos_token_ids=(), max_context=4096,
                       tokenizer_fingerprint="random")  # fmt: skip


def generate(target: TargetEngine, draft: DraftEngine | None, tree: TreeParams | None, tokens: int,
             curves: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:  # fmt: skip
    """One greedy generation; its steps' measured and predicted seconds, the first step left out."""
    prompt = [(7 * i + 3) % 1000 for i in range(64)]
    seq = Sequence(target, draft, prompt)
    stats = GenerationStats()
    rows: list[dict[str, float]] = []
    draft_model = id(draft.loaded.model) if draft is not None else None
    start = time.perf_counter()
    last = (0.0, 0.0)
    for result in seq.steps(SamplingParams(max_new_tokens=tokens, ignore_eos=True), tree, stats):
        draft_s, target_s = stats.draft_seconds - last[0], stats.target_seconds - last[1]
        last = (stats.draft_seconds, stats.target_seconds)
        size = stats.budgets[-1] + 1 if draft is not None and stats.budgets else 1
        passes = PASSES.pop(draft_model, []) if draft_model is not None else []
        rows.append({"tokens": len(result.tokens), "tree": size, "draft_s": draft_s, "target_s": target_s,
                     "draft_predicted_s": sum(interpolate(curves["draft"], n) for n in passes),
                     "draft_passes": len(passes), "target_predicted_s": interpolate(curves["target"], size)})  # fmt: skip
    wall = time.perf_counter() - start
    seq.close()
    steady = rows[1:]
    total = {k: sum(r[k] for r in steady) for k in steady[0]}
    return {"tok_s": stats.new_tokens / wall, "steps": len(rows), "tokens_per_step": stats.tokens_per_step,
            "per_step": {k: v / len(steady) for k, v in total.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--target-layers", type=int, default=0, help="the target's --n-gpu-layers")
    ap.add_argument("--draft-layers", type=int, default=99, help="the draft's --n-gpu-layers")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64, 128])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--target-threads", type=int, help="llama.cpp's CPU threads (default: the nodes')")
    ap.add_argument("--draft-threads", type=int)
    ap.add_argument("--curves-from", type=Path, help="an earlier --out's curves, instead of measuring them")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    record_passes()
    models = {"target": loaded(args.target, args.target_layers, args.target_threads),
              "draft": loaded(args.draft, args.draft_layers, args.draft_threads)}  # fmt: skip
    curves = json.loads(args.curves_from.read_text())["curves"] if args.curves_from else {}
    for role, m in models.items():
        if role in curves:
            continue
        started = time.perf_counter()
        curves[role] = forward_curve(m.model, max(args.budgets) + 1, 1.0, progress=False)
        print(f"{role} curve in {time.perf_counter() - started:.0f} s: "
              + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in curves[role] if n & (n - 1) == 0))  # fmt: skip
    cap = max(args.budgets)
    target = TargetEngine(models["target"], max_context=4096, max_tree=cap + 1, max_sessions=1)
    draft = DraftEngine(models["draft"], max_context=4096, max_tree=cap, max_sessions=1)
    runs: dict[str, Any] = {"target alone": generate(target, None, None, args.tokens, curves)}
    for budget in args.budgets:
        runs[f"tree of {budget}"] = generate(target, draft, TreeParams(budget=budget), args.tokens, curves)
    threads = {role: m.model.threads for role, m in models.items()}
    print(f"target {args.target.name} ({args.target_layers} GPU layers, {threads['target']} threads), draft "
          f"{args.draft.name} ({args.draft_layers} GPU layers, {threads['draft']} threads), {args.tokens} tokens; "
          "per steady step, in ms:")  # fmt: skip
    print("| run | tok/s | tokens/step | tree | draft passes | draft | its curve says | target | its curve says |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        s = r["per_step"]
        print(f"| {name} | {r['tok_s']:.1f} | {r['tokens_per_step']:.2f} | {s['tree']:.0f} | {s['draft_passes']:.1f} | {s['draft_s'] * 1e3:.1f} "
              f"| {s['draft_predicted_s'] * 1e3:.1f} | {s['target_s'] * 1e3:.1f} | {s['target_predicted_s'] * 1e3:.1f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"curves": curves, "runs": runs}, indent=1))
    target.close()
    draft.close()


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
