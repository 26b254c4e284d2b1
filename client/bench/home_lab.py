"""`specexec bench --home-lab`: two machines emulated on one, each node pinned to its own cores with
one thread, and the question the product must answer: does the second machine pay?

Contestants, interleaved prompt by prompt, in alternating order:
- the target alone (its node, root-only trees);
- the sequential split: a draft node that works only when asked (`--no-lookahead`);
- the pipelined split: a draft node that grows the next tree while the target verifies;
- one process running both models on the target's cores.
The client runs on the draft's cores: on a home network it sits beside the laptop, not the big box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from client.api import Completion, SpecExec, collect
from client.bench.harness import SETTINGS, encode, free_port, load_prompts, stop_processes
from client.bench.llama_cpp import LlamaItself
from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.llama_cpp import MAX_TREE_LEAVES, find_gguf
from common.model.store import resolve_gguf, resolve_model
from common.options import node_command

CONTESTANTS = ("target alone", "split, sequential", "split, pipelined", "one process", "llama.cpp itself")
LLAMA_ITSELF = CONTESTANTS[-1]  # llama-cpp-python's own generation on the target's cores (llama.cpp lab, greedy)


@dataclass(frozen=True)
class HomeLabConfig:
    draft_model: str = "qwen2.5-coder-0.5b"
    target_model: str = "qwen2.5-coder-1.5b"
    dtype: str = "bfloat16"
    draft_quantize: str = "int8"
    draft_cores: tuple[int, ...] = (0,)
    target_cores: tuple[int, ...] = (1,)
    prompts: str | None = None
    categories: tuple[str, ...] | None = None
    limit: int | None = 4
    max_new_tokens: int = 128
    max_budget: int = 256  # --budget auto's cap, and the nodes' --max-tree
    settings: tuple[str, ...] = ("greedy",)
    seed: int = 0
    rtt_ms: float = 0.0  # client-target round trip, through client.bench.relay
    backend: str = "torch"  # both models' backend; llama.cpp runs their GGUF files (--format gguf installs)
    draft_backend: str | None = None  # the draft's, where it differs from the target's

    @property
    def draft_runs_on(self) -> str:
        return self.draft_backend or self.backend
    out: Path = field(default_factory=lambda: Path("bench-results/home-lab"))


@dataclass
class LabRun:
    contestant: str
    prompt: int
    category: str
    setting: str
    tokens: list[int]
    stats: dict[str, Any]


def lab_models(config: HomeLabConfig) -> tuple[str, str]:
    """The draft's and the target's model directories for their backends."""
    return model_dir(config.draft_model, config.draft_runs_on), model_dir(config.target_model, config.backend)


def model_dir(name: str, backend: str) -> str:
    """An installed model's directory for `backend` (llama.cpp: its GGUF's)."""
    if backend == "torch":
        return str(resolve_model(name))
    found = resolve_gguf(name)
    if found is None:
        raise ValueError(f"no GGUF for {name!r}: run `specexec models install {name} --format gguf`")
    return str(found)


def pinned(cmd: list[str], cores: tuple[int, ...]) -> tuple[list[str], dict[str, str]]:
    """One thread on its own cores: what a node on a machine of its own would get from this one."""
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "MKL_NUM_THREADS": str(len(cores))}
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd], env


class Lab:
    """The node processes and the one-process worker, started once, stopped by `close`."""

    def __init__(self, config: HomeLabConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.addrs: dict[str, str] = {}
        draft, target = lab_models(config)
        quantize = config.draft_quantize if config.draft_runs_on == "torch" else "none"
        nodes = (
            ("target", "target", target, config.target_cores, "none", False, config.backend),
            ("draft-seq", "draft", draft, config.draft_cores, quantize, False, config.draft_runs_on),
            ("draft-pipe", "draft", draft, config.draft_cores, quantize, True, config.draft_runs_on),
        )
        for name, role, model, cores, quantize, lookahead, backend in nodes:
            port = free_port()
            max_tree = config.max_budget if backend == "torch" else min(config.max_budget, MAX_TREE_LEAVES)
            cmd = node_command(role, model, port, config.dtype, max_tree, ["--backend", backend], quantize, lookahead)
            argv, env = pinned(cmd, cores)
            proc = subprocess.Popen(argv, env=env)
            self.procs.append(proc)
            self.addrs[name] = f"127.0.0.1:{port}"
            # One at a time: two drafts profiling on one core at once would each measure half a core.
            wait_until_serving(self.addrs[name], timeout=1800, alive=lambda p=proc: p.poll() is None)
        self.target = self.addrs["target"]
        if config.rtt_ms:
            port = free_port()
            relay = [sys.executable, "-m", "client.bench.relay", str(port), self.target, str(config.rtt_ms)]
            argv, env = pinned(relay, config.draft_cores)
            self.relay = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
            self.procs.append(self.relay)
            if self.relay.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError("the delaying relay did not start")
            self.target = f"127.0.0.1:{port}"
        self.itself = None
        if config.backend == "llama.cpp":
            gguf = find_gguf(Path(target))
            assert gguf is not None
            prefix, env = pinned([], config.target_cores)
            self.itself = LlamaItself(gguf, 1, prefix, env)
            self.procs.append(self.itself.proc)
        argv, env = pinned([sys.executable, "-m", "client.bench.home_lab", json.dumps(asdict(config), default=str)],
                           config.target_cores)  # fmt: skip
        self.worker = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(self.worker)
        if self.worker.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the one-process worker did not start")

    def generators(self) -> dict[str, Callable[[list[int], SamplingParams], Completion]]:
        tree = TreeParams(budget=self.config.max_budget)
        t = self.target  # through the relay, with --rtt-ms
        alone = connect(None, t, mode="autoregressive")
        seq = connect(self.addrs["draft-seq"], t, tree=tree, auto_budget=True)
        pipe = connect(self.addrs["draft-pipe"], t, tree=tree, auto_budget=True)
        return {
            "target alone": lambda ids, s: alone.generate(ids, s),
            "split, sequential": lambda ids, s: seq.generate(ids, s),
            "split, pipelined": lambda ids, s: pipe.generate(ids, s),
            "one process": self._in_worker,
            LLAMA_ITSELF: self._llama_itself,
        }

    def _llama_itself(self, ids: list[int], sampling: SamplingParams) -> Completion:
        """llama.cpp itself, greedy, in a pinned process of its own (client.bench.llama_cpp.LlamaItself)."""
        assert self.itself is not None
        tokens, wall = self.itself(ids, sampling.max_new_tokens)
        stats = {"tokens_per_second": len(tokens) / wall, "wall_seconds": wall, "target_steps": len(tokens),
                 "new_tokens": len(tokens), "draft_seconds": 0.0, "target_seconds": wall, "network_seconds": 0.0}
        return Completion(text="", token_ids=tokens, finish_reason="length", stats=_Stats(stats))

    def _in_worker(self, ids: list[int], sampling: SamplingParams) -> Completion:
        assert self.worker.stdin is not None and self.worker.stdout is not None
        self.worker.stdin.write(json.dumps({"ids": ids, "sampling": asdict(sampling)}) + "\n")
        self.worker.stdin.flush()
        reply = json.loads(self.worker.stdout.readline())
        return Completion(text="", token_ids=reply["tokens"], finish_reason=reply["finish"], stats=_Stats(reply["stats"]))

    def close(self) -> None:
        stop_processes(self.procs)


class _Stats:
    """The worker's stats as they came over its pipe (GenerationStats.as_dict)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def as_dict(self) -> dict[str, Any]:
        return self._stats


def worker_main(config: HomeLabConfig) -> None:
    """The one-process contestant: both models in this (pinned, one-thread) process."""
    torch.set_num_threads(1)
    draft, target = lab_models(config)
    llama = "llama.cpp" in (config.backend, config.draft_runs_on)
    gen = SpecExec.local(
        draft,
        target,
        dtype=config.dtype,
        draft_quantize=config.draft_quantize if config.draft_runs_on == "torch" else "none",
        tree=TreeParams(budget=min(config.max_budget, MAX_TREE_LEAVES) if llama else config.max_budget),
        auto_budget=True,
        backend=config.backend,
        draft_backend=config.draft_runs_on,
    )
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sampling = SamplingParams(**{**request["sampling"], "stop": tuple(request["sampling"]["stop"])})
        out = collect(gen.stream(request["ids"], sampling))
        reply = {"tokens": out.token_ids, "finish": out.finish_reason, "stats": out.stats.as_dict()}
        print(json.dumps(reply), flush=True)


def contestants(config: HomeLabConfig, setting: str) -> tuple[str, ...]:
    """llama.cpp itself runs in a llama.cpp lab, greedy (its own sampler draws other samples)."""
    if config.backend == "llama.cpp" and setting == "greedy":
        return CONTESTANTS
    return CONTESTANTS[:-1]


def run(config: HomeLabConfig) -> list[LabRun]:
    os.sched_setaffinity(0, set(config.draft_cores))
    torch.set_num_threads(1)
    lab = Lab(config)
    runs: list[LabRun] = []
    try:
        gens = lab.generators()
        tokenizer = connect(None, lab.addrs["target"], mode="autoregressive").tokenizer
        prompts = load_prompts(config.prompts, config.limit, config.categories)
        total = len(prompts) * sum(len(contestants(config, s)) for s in config.settings)
        with tqdm(total=total, desc="home lab", unit="run") as bar:
            for i, p in enumerate(prompts):
                ids = encode(tokenizer, p["prompt"])
                for setting in config.settings:
                    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, seed=config.seed + i,
                                              **SETTINGS[setting])  # fmt: skip
                    names = contestants(config, setting)
                    for name in names:  # untimed: first-call costs stay out of the figures
                        gens[name](ids, SamplingParams(max_new_tokens=4, **SETTINGS[setting]))
                    for name in names[:: -1 if i % 2 else 1]:  # alternating: no contestant always runs first
                        time.sleep(1.0)  # the last run's lookahead settles before the next run
                        out = gens[name](ids, sampling)
                        runs.append(LabRun(name, i, p["category"], setting, out.token_ids, out.stats.as_dict()))
                        bar.update()
    finally:
        lab.close()
    return runs


def summarize(runs: list[LabRun]) -> list[dict[str, Any]]:
    """Geometric means of each run's speed over the target alone's on the same prompt, per cell."""
    rows = []
    cells = sorted({(r.setting, r.category) for r in runs})
    for setting, category in cells:
        base = {r.prompt: r for r in runs if (r.setting, r.category, r.contestant) == (setting, category, CONTESTANTS[0])}
        for name in CONTESTANTS:
            mine = [r for r in runs if (r.setting, r.category, r.contestant) == (setting, category, name)]
            if not mine:
                continue
            ratios = [r.stats["tokens_per_second"] / base[r.prompt].stats["tokens_per_second"] for r in mine]
            seq = {r.prompt: r for r in runs if (r.setting, r.category, r.contestant) == (setting, category, CONTESTANTS[1])}
            vs_seq = [r.stats["tokens_per_second"] / seq[r.prompt].stats["tokens_per_second"] for r in mine]
            wall = sum(r.stats["wall_seconds"] for r in mine)
            steps = sum(r.stats["target_steps"] for r in mine)
            rows.append({
                "setting": setting, "category": category, "contestant": name, "runs": len(mine),
                "tok_s": _mean([r.stats["tokens_per_second"] for r in mine]),
                "vs_target": _geomean(ratios), "vs_sequential": _geomean(vs_seq),
                "tokens_per_pass": sum(r.stats["new_tokens"] for r in mine) / max(steps, 1),
                "draft_share": sum(r.stats["draft_seconds"] for r in mine) / wall,
                "target_share": sum(r.stats["target_seconds"] for r in mine) / wall,
                "wire_share": sum(r.stats["network_seconds"] for r in mine) / wall,
                "reused": sum(r.stats.get("reused_trees", 0) for r in mine) / max(steps, 1),
                **_per_step(mine),
                "same_tokens": all(r.tokens == base[r.prompt].tokens for r in mine),
            })  # fmt: skip
    return rows


def _per_step(runs: list[LabRun]) -> dict[str, float | None]:
    """Milliseconds a step waited for the target, and for the draft on a tree it re-rooted and on
    one it built afresh (None: no such step): what bounds a pipelined split's steps."""
    total = {k: sum(r.stats.get(k, 0) for r in runs)
             for k in ("target_seconds", "target_steps", "draft_seconds", "reused_draft_seconds", "reused_trees")}  # fmt: skip
    drafted = sum(r.stats.get("drafted_steps", 0) for r in runs)
    fresh = drafted - total["reused_trees"]

    def ms(seconds: float, steps: float) -> float | None:
        return 1000 * seconds / steps if steps else None

    return {"target_ms": ms(total["target_seconds"], total["target_steps"]),
            "draft_ms_rerooted": ms(total["reused_draft_seconds"], total["reused_trees"]),
            "draft_ms_fresh": ms(total["draft_seconds"] - total["reused_draft_seconds"], fresh)}  # fmt: skip


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _geomean(xs: list[float]) -> float:
    return float(torch.tensor(xs).log().mean().exp())


def write_report(out: Path, config: HomeLabConfig, runs: list[LabRun], rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"config": asdict(config), "runs": [asdict(r) for r in runs], "summary": rows}, indent=1, default=str))  # fmt: skip
    lines = [
        "# Home lab: draft and target on separate cores, one thread each", "",
        f"draft {config.draft_model} ({_weights(config.draft_runs_on, config.draft_quantize)}) -> target "
        f"{config.target_model} ({_weights(config.backend, config.dtype)}), " +
        f"draft cores {config.draft_cores}, target cores {config.target_cores}, {config.max_new_tokens} tokens, "
        f"--budget auto (cap {config.max_budget}), client-target round trip "
        f"{config.rtt_ms:g} ms{' (delaying relay)' if config.rtt_ms else ''}.", "",
        "| setting | category | contestant | runs | tok/s | x target alone | x sequential | tokens/pass "
        "| draft wait | target | wire | re-rooted trees | target ms a step | draft ms, re-rooted tree | fresh tree "
        "| same tokens as target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['category']} | {r['contestant']} | {r['runs']} | {r['tok_s']:.2f} "
            f"| {r['vs_target']:.2f} | {r['vs_sequential']:.2f} | {r['tokens_per_pass']:.2f} "
            f"| {r['draft_share']:.0%} | {r['target_share']:.0%} | {r['wire_share']:.1%} | {r['reused']:.0%} "
            f"| {_ms(r['target_ms'])} | {_ms(r['draft_ms_rerooted'])} | {_ms(r['draft_ms_fresh'])} "
            f"| {'yes' if r['same_tokens'] else 'no'} |"
        )
    lines += ["", "x: geometric mean of per-prompt speed ratios. Draft wait, target, wire: shares of the wall "
              "time the client spent waiting on each. Re-rooted trees: the share of steps whose tree grew from "
              "the draft's lookahead search. Target ms a step: the target node's own time a step; draft ms: the "
              "draft node's time for a tree it re-rooted (what its search had left to do) and for one it "
              "built afresh."]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot(out / "home-lab.png", rows)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _weights(backend: str, torch_weights: str) -> str:
    return "its GGUF on llama.cpp" if backend == "llama.cpp" else f"{torch_weights} on torch"


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["setting"], r["category"]) for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [name for name in CONTESTANTS if any(r["contestant"] == name for r in rows)]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ys = [next((r["vs_target"] for r in rows if (r["setting"], r["category"]) == c and r["contestant"] == name), 0)
              for c in cells]  # fmt: skip
        ax.bar([i + k * width for i in range(len(cells))], ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [f"{s} {c}" for s, c in cells])
    ax.set_ylabel("speed / target alone")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    worker_main(HomeLabConfig(**{**raw, "out": Path(raw["out"]),
                                 **{k: tuple(raw[k]) for k in ("draft_cores", "target_cores", "settings")},
                                 "categories": tuple(raw["categories"]) if raw["categories"] else None}))  # fmt: skip
