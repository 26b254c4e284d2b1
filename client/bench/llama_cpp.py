"""`specexec bench --llama-cpp`: our llama.cpp backend against llama.cpp itself, on the target's
own GGUF, and against our torch backend, interleaved prompt by prompt (greedy).

Contestants: llama-cpp-python's own generation on the file; our target alone and `--budget auto`
SpecExec on each backend (the draft on torch, int8), and SpecExec with both models on llama.cpp when
the draft's GGUF is installed. Also: each backend's forward-time curve (1 to 256 tree tokens) and
the draft's on each (1 to 64), the llama.cpp target's resident memory against the file's size, and how often
SpecExec's greedy text leaves its own backend's autoregressive text (llama.cpp's batched kernels
are not bit-identical to its one-token ones).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from client.api import SpecExec
from client.bench.harness import encode, load_prompts, stop_processes
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.llama_cpp import find_gguf, load_gguf
from common.model.loading import load_model
from common.model.profiling import forward_curve
from common.model.quantized_linear import draft_dtype
from common.model.store import resolve_gguf, resolve_model
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

CURVE_LIMIT = 256
DRAFT_CURVE_LIMIT = 64  # the draft's passes are expansion batches (DraftEngine.profile_limit)
LLAMA_ITSELF = "llama.cpp itself"


@dataclass(frozen=True)
class LlamaBenchConfig:
    draft_model: str = "qwen2.5-coder-0.5b"
    target_model: str = "qwen2.5-coder-1.5b"
    dtype: str = "float32"  # the torch target's
    draft_quantize: str = "int8"
    prompts: str | None = None
    categories: tuple[str, ...] | None = None
    limit: int | None = 4
    max_new_tokens: int = 64
    auto_cap: int = 64
    threads: int = field(default_factory=torch.get_num_threads)
    out: Path = field(default_factory=lambda: Path("bench-results/llama-cpp"))


def llama_itself(gguf: Path, threads: int) -> Any:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        # generate() reuses the KV of the longest prefix it saw last time (the warm-up's prompt), and
        # ours reads every prompt afresh: forget it, so both runs include the prompt's pass.
        llm.reset()
        start, out = time.perf_counter(), []
        for token in llm.generate(ids, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out, time.perf_counter() - start

    return run


class LlamaItself:
    """llama.cpp itself in a process of its own that holds only its model, as a user runs it. It
    inherits the bench's environment, so it runs on huge pages where our nodes do
    (common.ops.hugepages): on 4 KiB pages whichever process loaded its model second decoded about
    15% faster on the AMX Xeon, which had favoured llama.cpp itself, started after our target."""

    def __init__(self, gguf: Path, threads: int, prefix: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        """`prefix`, `env`: how to start it (the home lab pins it with taskset)."""
        cmd = [*(prefix or []), sys.executable, "-m", "client.bench.llama_cpp", str(gguf), str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"llama.cpp itself did not start on {gguf} (exit code {self.proc.poll()})")

    def __call__(self, ids: list[int], n: int) -> tuple[list[int], float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["tokens"], reply["seconds"]

    def close(self) -> None:
        stop_processes([self.proc])


def _serve_itself(gguf: str, threads: int) -> None:
    """`python -m client.bench.llama_cpp GGUF THREADS`: LlamaItself's process."""
    run = llama_itself(Path(gguf), threads)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens, seconds = run(request["ids"], request["n"])
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


def _ours(gen: SpecExec) -> Any:
    def run(ids: list[int], n: int) -> tuple[list[int], float, int]:
        out = gen.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        return out.token_ids, out.stats.wall_seconds, out.stats.target_steps

    return run


def resident_mb(gguf: Path, threads: int, repack: bool = True, sessions: int = 1) -> float:
    """Peak RSS of a process that runs the target node's engine as the node does (without torch: a
    llama.cpp node never loads it) on the GGUF, a 4096-token context per session, and verifies one
    64-node tree after a 500-token prompt; `sessions` > 1: the node's shared context for that many."""
    code = (
        "import sys, numpy as np; from common.model.llama_cpp import load_gguf; from common.ops.memory import peak_rss_bytes;"
        "from common.decoding.sampling import SamplingParams; from common.decoding.tree import TokenTree;"
        "from target_node.engine import TargetEngine;"
        "loaded = load_gguf(sys.argv[1], threads=int(sys.argv[2]), repack=sys.argv[3] == '1', tokenizer=False);"
        "e = TargetEngine(loaded, max_context=4096, max_tree=64, max_sessions=int(sys.argv[4]));"
        "sid = e.open_session(list(range(100, 600)));"
        "e.verify(sid, TokenTree(np.arange(599, 664), np.arange(-1, 64)), SamplingParams(), 8);"
        "assert 'torch' not in sys.modules; print(peak_rss_bytes() / 2**20)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(gguf), str(threads), str(int(repack)), str(sessions)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return float(run.stdout.strip().splitlines()[-1])


def run(config: LlamaBenchConfig) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    gguf_dir = resolve_gguf(config.target_model)
    if gguf_dir is None:
        raise ValueError(
            f"no GGUF for {config.target_model!r}: run `specexec models install {config.target_model} --format gguf`"
        )
    gguf = find_gguf(gguf_dir)
    assert gguf is not None
    tree = TreeParams(budget=config.auto_cap)
    llama_t = TargetEngine(load_gguf(gguf_dir, threads=config.threads), max_tree=max(config.auto_cap, CURVE_LIMIT - 1))
    torch_loaded = load_model(resolve_model(config.target_model), dtype=config.dtype)
    torch_t = TargetEngine(torch_loaded, max_tree=CURVE_LIMIT)
    draft_loaded = load_model(resolve_model(config.draft_model), dtype=draft_dtype(config.dtype, config.draft_quantize),
                              quantize=config.draft_quantize)  # fmt: skip
    draft = DraftEngine(draft_loaded, max_tree=config.auto_cap)
    draft_gguf = resolve_gguf(config.draft_model)
    llama_draft = DraftEngine(load_gguf(draft_gguf, threads=config.threads), max_tree=config.auto_cap) if draft_gguf else None
    curves = {
        "llama.cpp": forward_curve(llama_t.loaded.model, CURVE_LIMIT, 1.0),
        f"torch ({config.dtype})": forward_curve(torch_loaded.model, CURVE_LIMIT, 0.5),
    }
    def up_to_cap(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
        return [c for c in curve if c[0] <= config.auto_cap + 1]

    llama_t.use_curve(up_to_cap(curves["llama.cpp"]))
    torch_t.use_curve(up_to_cap(curves[f"torch ({config.dtype})"]))
    draft_curves = {f"draft, torch ({config.draft_quantize})": forward_curve(draft_loaded.model, DRAFT_CURVE_LIMIT, 1.0)}
    draft.use_curve(up_to_cap(draft_curves[f"draft, torch ({config.draft_quantize})"]))
    if llama_draft is not None:
        draft_curves["draft, llama.cpp"] = forward_curve(llama_draft.loaded.model, DRAFT_CURVE_LIMIT, 1.0)
        llama_draft.use_curve(up_to_cap(draft_curves["draft, llama.cpp"]))
    tok = torch_loaded.tokenizer
    itself = LlamaItself(gguf, config.threads)
    contestants = {
        LLAMA_ITSELF: itself,
        "ours, llama.cpp, target alone": _ours(SpecExec(llama_t, None, tok, mode="autoregressive")),
        "ours, llama.cpp, specexec auto": _ours(SpecExec(llama_t, draft, tok, tree=tree, auto_budget=True)),
        **({"ours, llama.cpp, specexec auto, llama.cpp draft": _ours(SpecExec(llama_t, llama_draft, tok, tree=tree,
                                                                               auto_budget=True))}
           if llama_draft is not None else {}),
        f"ours, torch {config.dtype}, target alone": _ours(SpecExec(torch_t, None, tok, mode="autoregressive")),
        f"ours, torch {config.dtype}, specexec auto": _ours(SpecExec(torch_t, draft, tok, tree=tree, auto_budget=True)),
    }  # fmt: skip
    prompts = load_prompts(config.prompts, config.limit, config.categories)
    runs = []
    try:
        with tqdm(total=len(prompts) * len(contestants), desc="llama.cpp bench", unit="run") as bar:
            for i, p in enumerate(prompts):
                ids = encode(tok, p["prompt"])
                for fn in contestants.values():
                    fn(ids, 4)  # untimed warm-up
                for name, fn in contestants.items():
                    out = fn(ids, config.max_new_tokens)
                    runs.append({"contestant": name, "prompt": i, "category": p["category"], "tokens": out[0],
                                 "wall": out[1], "steps": out[2] if len(out) > 2 else len(out[0])})  # fmt: skip
                    bar.update()
    finally:
        itself.close()
    return {"config": asdict(config), "runs": runs, "curves": curves, "draft_curves": draft_curves,
            "gguf_mb": gguf.stat().st_size / 2**20,
            "llama_rss_mb": resident_mb(gguf, config.threads),
            "llama_rss_no_repack_mb": resident_mb(gguf, config.threads, repack=False)}  # fmt: skip


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    runs = result["runs"]
    base = {(r["prompt"]): r for r in runs if r["contestant"] == LLAMA_ITSELF}
    rows = []
    for category in sorted({r["category"] for r in runs}):
        for name in dict.fromkeys(r["contestant"] for r in runs):
            mine = [r for r in runs if r["contestant"] == name and r["category"] == category]
            ref_name = name.replace(", llama.cpp draft", "").replace("specexec auto", "target alone")
            ref = {r["prompt"]: r["tokens"] for r in runs if r["contestant"] == ref_name}
            ratios = [(len(r["tokens"]) / r["wall"]) / (len(base[r["prompt"]]["tokens"]) / base[r["prompt"]]["wall"])
                      for r in mine]  # fmt: skip
            same = [r["tokens"] == ref[r["prompt"]] for r in mine] if ref_name != name else []
            rows.append({
                "category": category, "contestant": name, "runs": len(mine),
                "tok_s": sum(len(r["tokens"]) for r in mine) / sum(r["wall"] for r in mine),
                "vs_llama": float(torch.tensor(ratios).log().mean().exp()),
                "tokens_per_pass": sum(len(r["tokens"]) for r in mine) / max(sum(r["steps"] for r in mine), 1),
                "same": f"{sum(same)}/{len(same)}" if same else "",
            })  # fmt: skip
    return rows


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(result)
    (out / "results.json").write_text(json.dumps({**result, "summary": rows}, indent=1, default=str))
    cfg = result["config"]
    lines = [
        "# The llama.cpp backend against llama.cpp itself", "",
        f"{cfg['target_model']} GGUF ({result['gguf_mb']:.0f} MiB), {cfg['threads']} threads, greedy, "
        f"{cfg['max_new_tokens']} tokens, draft {cfg['draft_model']} ({cfg['draft_quantize']}, torch), "
        f"--budget auto (cap {cfg['auto_cap']}).", "",
        "| category | contestant | runs | tok/s | x llama.cpp itself | tokens/pass | same text as its target alone |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['category']} | {r['contestant']} | {r['runs']} | {r['tok_s']:.2f} | {r['vs_llama']:.2f} "
                     f"| {r['tokens_per_pass']:.2f} | {r['same']} |")  # fmt: skip
    rss, lean, size = result["llama_rss_mb"], result.get("llama_rss_no_repack_mb"), result["gguf_mb"]
    lines += ["", f"llama.cpp target: peak RSS {rss:.0f} MiB for a {size:.0f} MiB file ({rss / size:.2f}x)"
              + (f", {lean:.0f} MiB ({lean / size:.2f}x) with --no-repack" if lean else "")
              + "; 4096-token context, torch imported.", "",
              "Forward pass over a tree (ms):", ""]  # fmt: skip
    lines += _curve_table(result["curves"])
    if result.get("draft_curves"):
        lines += ["", "The draft's forward pass over an expansion batch (ms):", "", *_curve_table(result["draft_curves"])]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot({**result["curves"], **result.get("draft_curves", {})}, out / "forward-curves.png")


def _curve_table(curves: dict[str, list[tuple[int, float]]]) -> list[str]:
    lines = ["| tokens | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    sizes = [n for n, _ in next(iter(curves.values()))]
    for i, n in enumerate(sizes):
        lines.append(f"| {n} | " + " | ".join(f"{c[i][1] * 1e3:.1f}" for c in curves.values()) + " |")
    return lines


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curve in curves.items():
        ax.plot([n for n, _ in curve], [t * 1e3 for _, t in curve], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree tokens in one pass")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    _serve_itself(sys.argv[1], int(sys.argv[2]))
