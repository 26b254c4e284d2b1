"""`specexec bench`: SpecExec against the baselines a user would pick, on the same models, prompts,
dtype, lengths and machine, interleaved prompt by prompt so that drift in machine speed hits every
contestant alike. Writes raw measurements (JSON), a markdown report and plots to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from client.api import SpecExec, render_chat
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.compiled_forward import DEFAULT_BUCKETS, parse_buckets
from common.model.quantized_linear import QUANTIZE_CHOICES, draft_dtype
from common.ops.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from common.options import offload_flags

if TYPE_CHECKING:
    from common.model.offload import OffloadPlan
    from draft_node.engine import DraftEngine
    from target_node.engine import TargetEngine

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.6, "top_p": 0.9}
SETTINGS = {"greedy": GREEDY, "sampled": SAMPLED}


@dataclass
class Run:
    contestant: str
    prompt: int
    category: str
    setting: str
    token_ids: list[int]
    wall_seconds: float
    target_steps: int
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    network_seconds: float = 0.0  # gRPC: the calls' time less the nodes' own (draft and target exclude it)
    accepted_per_step: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # draft nodes proposed, per step that had a draft
    chain_steps: int = 0
    repeat: int = 0  # which pass over the prompt set
    peak_rss_mb: float | None = None  # of the processes that did the work, over this run (see meta)
    rss_growth_mb: float | None = None  # that peak less their RSS as the run began: the run's own memory
    peak_gpu_mb: float | None = None  # this process's peak CUDA allocation over the run (--device cuda)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.wall_seconds if self.wall_seconds else 0.0


@dataclass
class Contestant:
    name: str
    family: str  # "engine" (our verifier: exactness applies), "hf", or "grpc"
    run: Callable[[list[int], SamplingParams], Run]
    budget: int | None = None  # specexec budget, for the budget sweeps
    min_prob: float = 0.0  # the sweep's confidence floor: one line per floor in the plots
    min_node_prob: float = 0.0  # and its node floor
    processes: tuple[int | str, ...] = ("self",)  # whose memory the run's peak counts: the gRPC nodes'


def load_prompts(path: str | None, limit: int | None, categories: list[str] | None) -> list[dict[str, str]]:
    """Our set (written for this project in the style of MT-Bench and OASST questions) or a user's JSONL."""
    if path:
        lines = Path(path).read_text().splitlines()
    else:
        lines = resources.files("client").joinpath("data/bench_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()]
    for i, p in enumerate(prompts):
        if "prompt" not in p:
            raise ValueError(f"prompt file line {i + 1} has no 'prompt' field")
        p.setdefault("category", "other")
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
    if limit:
        # Keep the categories balanced when trimming: round-robin over them.
        by_cat: dict[str, list[dict[str, str]]] = {}
        for p in prompts:
            by_cat.setdefault(p["category"], []).append(p)
        mixed = [p for group in zip(*by_cat.values(), strict=False) for p in group]
        prompts = (mixed + [p for p in prompts if p not in mixed])[:limit]
    return prompts


def encode(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(prompt))


def engine_contestant(
    name: str,
    gen: SpecExec,
    budget: int | None = None,
    family: str = "engine",
    min_prob: float = 0.0,
    min_node_prob: float = 0.0,
    processes: tuple[int | str, ...] = ("self",),
) -> Contestant:
    def run(ids: list[int], sampling: SamplingParams) -> Run:
        out = gen.generate(ids, sampling)
        s = out.stats
        return Run(name, -1, "", "", out.token_ids, s.wall_seconds, s.target_steps, s.draft_seconds,
                   s.target_seconds, s.network_seconds, list(s.accepted_per_step), list(s.budgets),
                   s.chain_steps)  # fmt: skip

    return Contestant(name, family, run, budget, min_prob, min_node_prob, processes)


def hf_contestants(
    draft_dir: Path, target_dir: Path, dtype: torch.dtype, device: str = "cpu", offload: bool = False
) -> list[Contestant]:
    """`offload`: the target's weights stay in host RAM and accelerate's hooks move each module to
    `device` for its forward, which is how a Hugging Face user runs a model larger than the GPU.
    Assisted generation is then left out: it moves the draft's candidates to the target's
    `.device`, which an offloaded model reports as `meta`, and fails."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = (
        None if offload else AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval().to(device)
    )
    if offload:
        from accelerate import cpu_offload

        # Buffers too: left behind, the rotary tables are meta tensors a forward cannot read.
        cpu_offload(target, execution_device=torch.device(device), offload_buffers=True)
    else:
        target.to(device)

    def make(name: str, assistant: Any) -> Contestant:
        def run(ids: list[int], sampling: SamplingParams) -> Run:
            kwargs: dict[str, Any] = dict(
                max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.max_new_tokens
            )
            if sampling.greedy:
                kwargs["do_sample"] = False
            else:
                torch.manual_seed(sampling.seed)
                kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
            if assistant is not None:
                kwargs["assistant_model"] = assistant
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(torch.tensor([ids], device=device), pad_token_id=0, **kwargs)
            wall = time.perf_counter() - start
            new = out[0, len(ids) :].tolist()
            return Run(name, -1, "", "", new, wall, 0)

        return Contestant(name, "hf", run)

    return [make("hf generate", None)] + ([] if offload else [make("hf assisted", draft)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GrpcNodes:
    """A draft and a target node as separate processes on loopback, for the network-path contestant."""

    def __init__(
        self,
        draft: str,
        target: str,
        dtype: str,
        max_tree: int,
        draft_quantize: str = "none",
        device: str = "cpu",
        offload: OffloadPlan | None = None,
    ) -> None:
        from client.remote import wait_until_serving
        from common.options import node_command

        ports = {role: free_port() for role in ("target", "draft")}
        self.addrs = {role: f"127.0.0.1:{port}" for role, port in ports.items()}
        common = ["--no-profile", "--device", device]
        self.procs = [
            subprocess.Popen(
                node_command(role, model, ports[role], dtype, max_tree, common + extra, quantize)
            )
            for role, model, quantize, extra in (
                ("target", target, "none", offload_flags(offload)),
                ("draft", draft, draft_quantize, []),
            )
        ]
        for proc, addr in zip(self.procs, self.addrs.values(), strict=True):
            wait_until_serving(addr, timeout=900, alive=lambda p=proc: p.poll() is None)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(proc.pid for proc in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def build_contestants(
    args: argparse.Namespace, target, draft, tokenizer, draft_dir, target_dir
) -> list[Contestant]:
    tree = TreeParams(
        budget=1, max_depth=args.max_depth, max_branch=args.max_branch, expand_batch=args.expand_batch
    )
    out = [engine_contestant("autoregressive", SpecExec(target, None, tokenizer, mode="autoregressive"))]
    for k in args.chain:
        out.append(
            engine_contestant(
                f"chain k={k}", SpecExec(target, draft, tokenizer, mode="chain", tree=TreeParams.chain(k))
            )
        )
    for b in args.budgets:
        params = TreeParams(
            budget=b, max_depth=args.max_depth, max_branch=args.max_branch, expand_batch=args.expand_batch
        )
        out.append(
            engine_contestant(f"specexec b={b}", SpecExec(target, draft, tokenizer, tree=params), budget=b)
        )
    for p in args.min_probs:
        for k in args.chain:
            shape = TreeParams.chain(k, p)
            out.append(
                engine_contestant(
                    f"chain k={k} p={p:g}", SpecExec(target, draft, tokenizer, mode="chain", tree=shape)
                )
            )
        for b in args.budgets:
            for q in sorted({0.0, args.min_node_prob}):
                shape = replace(tree, budget=b, min_prob=p, min_node_prob=q)
                out.append(
                    engine_contestant(
                        f"specexec b={b} p={p:g}" + (f" q={q:g}" if q else ""),
                        SpecExec(target, draft, tokenizer, tree=shape),
                        budget=b,
                        min_prob=p,
                        min_node_prob=q,
                    )
                )
    if args.auto:
        params = TreeParams(budget=auto_cap(args), max_depth=tree.max_depth, max_branch=tree.max_branch,
                            expand_batch=tree.expand_batch)  # fmt: skip
        out.append(
            engine_contestant(
                "specexec auto", SpecExec(target, draft, tokenizer, tree=params, auto_budget=True)
            )
        )
    return out


def compiled_twins(contestants: list[Contestant], models: list[Any]) -> list[Contestant]:
    """Each contestant twice, interleaved: eager, then through the models' compiled forwards."""
    handles = [m.compiled for m in models]

    def switch(c: Contestant, on: bool) -> Contestant:
        def run(ids: list[int], sampling: SamplingParams) -> Run:
            for model, handle in zip(models, handles, strict=True):
                model.compiled = handle if on else None
            return c.run(ids, sampling)

        name = c.name + (" compiled" if on else "")
        return replace(c, name=name, run=run, budget=None if on else c.budget)

    return [twin for c in contestants for twin in (switch(c, False), switch(c, True))]


WARM_UP_TOKENS = 4


def run_phase(prompts, contestants, tokenizer, settings, max_new_tokens, seed, desc, repeats=1,
              memory: PeakMemory | None = None) -> list[Run]:  # fmt: skip
    """Contestants take turns, prompt by prompt; the order rotates each time, so none always runs
    first or last in a stretch of this machine's drifting speed. Repeats are whole passes over the
    prompt set, so a prompt's runs are far apart in time. Each contestant first generates a few
    untimed tokens: a first call pays one-off costs (weights paged in from a memory-mapped file,
    allocator growth, a node's first session) that are no part of its speed or working memory."""
    memory = memory or PeakMemory()
    if prompts:
        warm_up = SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
        for c in contestants:
            c.run(encode(tokenizer, prompts[0]["prompt"]), warm_up)
    runs: list[Run] = []
    total = repeats * len(prompts) * len(contestants) * len(settings)
    turn = 0
    with tqdm(total=total, desc=desc, unit="run", file=sys.stderr) as bar:
        for repeat, (i, p) in itertools.product(range(repeats), enumerate(prompts)):
            ids = encode(tokenizer, p["prompt"])
            for setting, extra in settings.items():
                sampling = SamplingParams(
                    max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed + i, **extra
                )
                shift, turn = turn % len(contestants), turn + 1
                for c in contestants[shift:] + contestants[:shift]:
                    r = memory.run(c, ids, sampling)
                    r.contestant, r.prompt, r.category, r.setting = c.name, i, p["category"], setting
                    r.repeat = repeat
                    runs.append(r)
                    bar.set_postfix_str(f"{c.name}: {r.tokens_per_second:.1f} tok/s")
                    bar.update()
    return runs


class PeakMemory:
    """Each run's peak memory, and each process's peak over its life.

    Every model lives in this process (or in both nodes) for the whole bench, so a run's peak is
    its own only where the kernel can lower the high-water mark first (Linux); elsewhere it is the
    process's peak so far. The lowering would lose the life peak (loading, the float32 pass), so it
    is read before each reset and kept here."""

    def __init__(self, device: str = "cpu") -> None:
        self.life: dict[int | str, int] = {}
        self.per_run = self._reset("self")
        self.cuda = torch.device(device) if torch.device(device).type == "cuda" else None

    def _reset(self, pid: int | str) -> bool:
        self.life[pid] = self._life_peak(pid)
        return reset_peak_rss(pid)

    def _life_peak(self, pid: int | str) -> int:
        with contextlib.suppress(ProcessLookupError):  # a node that died has no memory to report
            return max(self.life.get(pid, 0), peak_rss_bytes(pid))
        return self.life.get(pid, 0)

    def run(self, c: Contestant, ids: list[int], sampling: SamplingParams) -> Run:
        for pid in c.processes:
            self._reset(pid)
        resident = [rss_bytes(pid) for pid in c.processes]
        known = [b for b in resident if b is not None]
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        r = c.run(ids, sampling)
        if self.cuda is not None and "self" in c.processes:  # a node's GPU memory is its own
            r.peak_gpu_mb = torch.cuda.max_memory_allocated(self.cuda) / 2**20
        with contextlib.suppress(ProcessLookupError):
            r.peak_rss_mb = sum(peak_rss_bytes(pid) for pid in c.processes) / 2**20
            if self.per_run and len(known) == len(resident):
                r.rss_growth_mb = r.peak_rss_mb - sum(known) / 2**20
        return r

    def life_peak_mb(self, pids: tuple[int | str, ...] = ("self",)) -> float:
        return sum(self._life_peak(pid) for pid in pids) / 2**20


def check_exactness(runs: list[Run], families: dict[str, str]) -> list[dict[str, Any]]:
    """Every engine contestant against the target alone, per prompt and setting: first divergence."""
    reference = {(r.prompt, r.setting): r.token_ids for r in runs if r.contestant == "autoregressive"}
    rows = []
    for r in runs:
        if families.get(r.contestant) not in ("engine", "grpc") or r.contestant == "autoregressive":
            continue
        ref = reference[(r.prompt, r.setting)]
        first = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref, strict=False)) if a != b), None)
        if first is None and len(r.token_ids) != len(ref):
            first = min(len(r.token_ids), len(ref))
        rows.append(dict(contestant=r.contestant, prompt=r.prompt, setting=r.setting, first_divergence=first))
    return rows


def summarize(runs: list[Run], contestants: list[Contestant]) -> list[dict[str, Any]]:
    rows = []
    for c in contestants:
        for setting in sorted({r.setting for r in runs}):
            for category in ["all", *sorted({r.category for r in runs})]:
                sel = [r for r in runs if r.contestant == c.name and r.setting == setting
                       and category in ("all", r.category)]  # fmt: skip
                if not sel:
                    continue
                tps = [r.tokens_per_second for r in sel]
                steps = sum(r.target_steps for r in sel)
                tokens = sum(len(r.token_ids) for r in sel)
                wall = sum(r.wall_seconds for r in sel)
                draft = sum(r.draft_seconds for r in sel)
                target = sum(r.target_seconds for r in sel)
                network = sum(r.network_seconds for r in sel)
                peaks = [r.peak_rss_mb for r in sel if r.peak_rss_mb is not None]
                growth = [r.rss_growth_mb for r in sel if r.rss_growth_mb is not None]
                gpu = [r.peak_gpu_mb for r in sel if r.peak_gpu_mb is not None]
                hist: dict[int, int] = {}
                for r in sel:
                    for a in r.accepted_per_step:
                        hist[a] = hist.get(a, 0) + 1
                drafted = [b for r in sel for b in r.budgets]
                q = statistics.quantiles(tps, n=10, method="inclusive") if len(tps) >= 2 else [tps[0]] * 9
                rows.append(dict(
                    contestant=c.name, family=c.family, budget=c.budget, min_prob=c.min_prob,
                    min_node_prob=c.min_node_prob, setting=setting,
                    category=category,
                    tok_s_median=statistics.median(tps), tok_s_p10=q[0], tok_s_p90=q[-1],
                    tokens_per_step=tokens / steps if steps else None,
                    draft_share=draft / wall if steps else None, target_share=target / wall if steps else None,
                    network_share=network / wall if steps else None,
                    bookkeeping_share=(wall - draft - target - network) / wall if steps else None,
                    peak_rss_mb=max(peaks) if peaks else None,
                    rss_growth_mb=max(growth) if growth else None,
                    peak_gpu_mb=max(gpu) if gpu else None,
                    accepted_histogram=dict(sorted(hist.items())),
                    mean_draft_nodes=statistics.mean(drafted) if drafted else None,
                    chain_share=sum(r.chain_steps for r in sel) / len(drafted) if drafted else None,
                ))  # fmt: skip
    return rows


Speeds = dict[tuple[int, int], float]  # tok/s by (prompt, repeat)


def speeds_by_cell(runs: list[Run]) -> dict[tuple[str, str], dict[str, Speeds]]:
    """Each contestant's speeds per (setting, category), the category "all" included."""
    cells: dict[tuple[str, str], dict[str, Speeds]] = {}
    for setting in sorted({r.setting for r in runs}):
        for category in ["all", *sorted({r.category for r in runs})]:
            speeds = cells[(setting, category)] = {}
            for r in runs:
                if r.setting == setting and category in ("all", r.category):
                    speeds.setdefault(r.contestant, {})[(r.prompt, r.repeat)] = r.tokens_per_second
    return cells


def versus(runs: list[Run], mine: str, theirs: str) -> list[dict[str, Any]]:
    """One contestant against another per setting and category, on the runs they share: the geometric
    mean of the speed ratios (each prompt's own speed cancels) and how many runs it won."""
    rows = []
    for (setting, category), speeds in speeds_by_cell(runs).items():
        a, b = speeds.get(mine, {}), speeds.get(theirs, {})
        paired = [k for k in a.keys() & b.keys() if a[k] > 0 and b[k] > 0]
        if paired:
            ratio = math.exp(statistics.fmean(math.log(a[k] / b[k]) for k in paired))
            rows.append(dict(setting=setting, category=category, contestant=mine, versus=theirs, ratio=ratio,
                             wins=sum(a[k] > b[k] for k in paired), paired_runs=len(paired)))  # fmt: skip
    return rows


def rank(runs: list[Run]) -> list[dict[str, Any]]:
    """Every contestant's place per setting and category, with paired evidence beside it.

    One run per prompt is noisy, and prompts differ in speed far more than contestants do, so a
    place alone says little. Each place therefore says on how many of the same prompts (and
    repeats) the contestant beat the one just below it, and its speed-up over the target alone is
    the median of per-prompt ratios, in which each prompt's own speed cancels."""
    rows = []
    for (setting, category), speeds in speeds_by_cell(runs).items():
        reference = speeds.get("autoregressive", {})
        order = sorted(speeds, key=lambda name: -statistics.median(speeds[name].values()))
        for place, name in enumerate(order, 1):
            mine = speeds[name]
            ratios = [mine[k] / reference[k] for k in mine.keys() & reference.keys() if reference[k]]
            below = order[place] if place < len(order) else None
            theirs = speeds[below] if below else {}
            paired = mine.keys() & theirs.keys()
            rows.append(dict(
                setting=setting, category=category, place=place, contestant=name,
                tok_s_median=statistics.median(mine.values()),
                x_target_alone=statistics.median(ratios) if ratios else None,
                next_contestant=below,
                beat_next=sum(mine[k] > theirs[k] for k in paired), paired_runs=len(paired),
            ))  # fmt: skip
    return rows


def project(runs: list[Run], contestants: list[Contestant], target_bytes: int, bandwidth_gbps: float,
            per_token_ms: float) -> list[dict[str, Any]]:  # fmt: skip
    """Replay each run's measured draft time and acceptance against an offloaded target's pass time:
    weights streamed over PCIe per pass (bytes / bandwidth) plus a small per-token compute cost."""

    def pass_seconds(n: int) -> float:
        return target_bytes / (bandwidth_gbps * 1e9) + n * per_token_ms / 1e3

    rows = []
    for c in contestants:
        sel = [r for r in runs if r.contestant == c.name and r.target_steps]
        if not sel or c.family != "engine":
            continue
        tokens = sum(len(r.token_ids) for r in sel)
        steps = sum(r.target_steps for r in sel)
        passes = [pass_seconds(b + 1) for r in sel for b in r.budgets]
        passes += [pass_seconds(1)] * (steps - len(passes))  # steps the target ran alone
        seconds = sum(r.draft_seconds for r in sel) + sum(passes)
        rows.append(dict(contestant=c.name, budget=c.budget, min_prob=c.min_prob, min_node_prob=c.min_node_prob,
                         tokens_per_step=tokens / steps,
                         projected_tok_s=tokens / seconds, pass_seconds=sum(passes) / steps))  # fmt: skip
    return rows


def write_report(
    out: Path, meta: dict, summary: list[dict], ranking: list[dict], exact: list[dict], projection: list[dict]
) -> str:
    lines = [f"# Benchmark: {meta['target']} <- {meta['draft']}", "",
             f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, {meta['dtype']}, "
             f"{meta['threads']} threads, draft linears {meta.get('draft_quantize', 'none')}, "
             f"command: `{meta['command']}`", ""]  # fmt: skip
    for setting in sorted({r["setting"] for r in summary}):
        lines += [f"## {setting}", "", "| contestant | category | tok/s median (p10-p90) | tokens/step "
                  "| draft / target / network / bookkeeping | draft nodes/step (chain steps) | peak RSS MiB (run's own) |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary:
            if r["setting"] != setting:
                continue
            shares = " / ".join(f"{r[k]:.0%}" for k in SHARES) if r["draft_share"] is not None else "-"
            tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
            nodes = (f"{r['mean_draft_nodes']:.1f} ({r['chain_share']:.0%})"
                     if r.get("mean_draft_nodes") is not None else "-")  # fmt: skip
            peak = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") is not None else "-"
            if r.get("rss_growth_mb") is not None:
                peak += f" (+{max(0.0, r['rss_growth_mb']):.0f})"
            if r.get("peak_gpu_mb") is not None:
                peak += f", GPU {r['peak_gpu_mb']:.0f}"
            lines.append(f"| {r['contestant']} | {r['category']} | {r['tok_s_median']:.2f} "
                         f"({r['tok_s_p10']:.2f}-{r['tok_s_p90']:.2f}) | {tps} | {shares} | {nodes} | {peak} |")  # fmt: skip
        lines.append("")
    lines += [f"Peak RSS: the largest over a contestant's runs ({meta.get('peak_rss_scope', 'run')}), of this "
              "process, which holds every model, or of both node processes for the gRPC contestant; in brackets, "
              "the most a run rose above the RSS it began with: its own working memory (KV cache, trees, activations); "
              "with --device cuda, this process's peak CUDA allocation in a run.", ""]  # fmt: skip
    lines += acceptance_table(summary)
    lines += ["## Fastest per category", "",
              "The first three places; the last column pairs each with the contestant just below it, prompt by prompt.",
              "", "| setting | category | place | contestant | tok/s median | x the target alone | beat the next on |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in ranking:
        if r["place"] <= 3:
            speedup = f"{r['x_target_alone']:.2f}x" if r["x_target_alone"] else "-"
            paired = f"{r['beat_next']} of {r['paired_runs']}" if r["next_contestant"] else "-"
            lines.append(f"| {r['setting']} | {r['category']} | {r['place']} | {r['contestant']} | "
                         f"{r['tok_s_median']:.2f} | {speedup} | {paired} |")  # fmt: skip
    lines.append("")
    bad = [e for e in exact if e["first_divergence"] is not None]
    lines += ["## Exactness against the target alone", ""]
    if not exact:
        lines.append("not checked")
    elif not bad:
        lines.append(f"all {len(exact)} engine runs token-identical to the target alone")
    else:
        lines.append(f"{len(bad)} of {len(exact)} runs diverge (first position shown):")
        lines += [
            f"- {e['contestant']}, prompt {e['prompt']}, {e['setting']}: token {e['first_divergence']}"
            for e in bad
        ]
    if projection:
        lines += ["", f"## Projection: offloaded target ({meta['projection']})", "",
                  "Measured draft time and acceptance, replayed against a modelled target pass; not a measurement.", "",
                  "| contestant | tokens/step | modelled pass s | projected tok/s |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {p['contestant']} | {p['tokens_per_step']:.2f} | {p['pass_seconds']:.3f} | {p['projected_tok_s']:.2f} |"
                  for p in projection]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


SHARES = ("draft_share", "target_share", "network_share", "bookkeeping_share")
HISTOGRAM_COLUMNS = 10  # accepted lengths 0..9, then one column for 10 and more


def acceptance_table(summary: list[dict]) -> list[str]:
    """How many of the tree's tokens the target kept, step by step: the shape behind tokens/step
    (a long chain that is either kept whole or cut at once looks unlike a bushy tree)."""
    rows = [r for r in summary if r["category"] == "all" and r.get("accepted_histogram")]
    if not rows:
        return []
    top = HISTOGRAM_COLUMNS
    lines = ["## Accepted draft tokens per target step", "",
             "Share of steps by how many drafted tokens the target kept (the step's own token not counted); all prompts.", "",
             "| setting | contestant | steps | " + " | ".join(map(str, range(top))) + f" | {top}+ |",
             "|---|---|---|" + "---|" * (top + 1)]  # fmt: skip
    for r in rows:
        hist = {int(k): v for k, v in r["accepted_histogram"].items()}  # JSON keys are strings
        steps = sum(hist.values())
        counts = [hist.get(n, 0) for n in range(top)] + [sum(v for k, v in hist.items() if k >= top)]
        cells = " | ".join(f"{c / steps:.0%}" if c else "" for c in counts)
        lines.append(f"| {r['setting']} | {r['contestant']} | {steps} | {cells} |")
    return [*lines, ""]


def _floors(row: dict) -> tuple[float, float]:
    """A row's floors; JSON from before a field existed has none."""
    return row.get("min_prob", 0.0), row.get("min_node_prob", 0.0)


def _floors_label(floors: tuple[float, float]) -> str:
    p, q = floors
    return (f", floor {p:g}" if p else "") + (f", node floor {q:g}" if q else "")


def plot(out: Path, summary: list[dict], projection: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    floors = sorted({_floors(r) for r in summary if r["budget"]})
    for setting in sorted({r["setting"] for r in summary}):
        for f in floors:
            rows = sorted((r for r in summary if r["setting"] == setting and r["category"] == "all"
                           and r["budget"] and _floors(r) == f), key=lambda r: r["budget"])  # fmt: skip
            if not rows:
                continue
            label = setting + _floors_label(f)
            style = "^--" if f[0] else "o-"
            axes[0].plot(
                [r["budget"] for r in rows], [r["tokens_per_step"] for r in rows], style, label=label
            )
            axes[1].plot([r["budget"] for r in rows], [r["tok_s_median"] for r in rows], style, label=label)
        for r in summary:
            if r["setting"] == setting and r["category"] == "all" and r["contestant"] == "autoregressive":
                axes[1].axhline(
                    r["tok_s_median"], linestyle="--", color="grey", label=f"target alone ({setting})"
                )
    for f in floors:
        rows = sorted((r for r in projection if r["budget"] and _floors(r) == f), key=lambda r: r["budget"])
        if rows:
            label = "projected offload" + _floors_label(f)
            axes[1].plot([r["budget"] for r in rows], [r["projected_tok_s"] for r in rows], "s:", label=label)
    for ax, title in ((axes[0], "tokens per target pass"), (axes[1], "tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_title(title)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    shown = min({r["setting"] for r in summary}, key=list(SETTINGS).index)  # greedy where it ran
    rows = [
        r
        for r in summary
        if r["category"] == "all" and r["draft_share"] is not None and r["setting"] == shown
    ]
    names = [r["contestant"] for r in rows]
    bottom = [0.0] * len(rows)
    for key in SHARES:
        vals = [r.get(key, 0.0) for r in rows]
        label = key.removesuffix("_share")
        axes[2].barh(names, vals, left=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[2].set_title(f"time per step ({shown})")
    axes[2].legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def profiled_default_pair(max_tree: int = 64) -> tuple[TargetEngine, DraftEngine, Any]:
    """The default pair as the measured runs use it (bf16 target, int8 draft), each engine with its
    forward-time curve: (target engine, draft engine, tokenizer), for scripts that race variants."""
    from common.model.loading import load_model
    from common.model.store import resolve_model
    from draft_node.engine import DraftEngine
    from target_node.engine import TargetEngine

    target_model = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype="bfloat16")
    draft_model = load_model(
        resolve_model("qwen2.5-coder-0.5b"), dtype=draft_dtype("bfloat16", "int8"), quantize="int8"
    )
    target, draft = TargetEngine(target_model, max_tree=max_tree), DraftEngine(draft_model, max_tree=max_tree)
    target.profile()
    draft.profile()
    return target, draft, target_model.tokenizer


def cmd_bench(args: argparse.Namespace) -> int:
    from common.model.loading import load_model
    from common.model.offload import load_target
    from common.model.store import resolve_model
    from common.options import offload_plan
    from draft_node.engine import DraftEngine
    from target_node.engine import TargetEngine

    torch.set_num_threads(args.threads)
    plan = offload_plan(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft_dir, target_dir = resolve_model(args.draft_model), resolve_model(args.target_model)
    prompts = load_prompts(args.prompts, args.limit, args.categories)
    settings = {name: SETTINGS[name] for name in bench_settings(args)}
    max_tree = max(
        [*args.budgets, *args.chain, auto_cap(args) if args.auto else 1, args.grpc_budget if args.grpc else 1]
    )
    meta = dict(target=target_dir.name, draft=draft_dir.name, prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                dtype=args.dtype, threads=args.threads, command="specexec bench " + " ".join(sys.argv[2:]),
                projection=args.target_cost_model, draft_quantize=args.draft_quantize, settings=list(settings),
                auto_cap=auto_cap(args) if args.auto else None, device=args.device,
                offload=asdict(plan) if plan else None)  # fmt: skip
    memory = PeakMemory(args.device)
    meta["peak_rss_scope"] = "run" if memory.per_run else "process so far"
    exact: list[dict] = []
    if args.exactness:
        # float32: batched tree passes and one-token passes then agree, so any divergence is a bug.
        t32 = load_target(target_dir, dtype="float32", device=args.device, plan=plan)
        d32 = load_model(draft_dir, dtype="float32", device=args.device, quantize=args.draft_quantize)
        target, draft = TargetEngine(t32, max_tree=max_tree), DraftEngine(d32, max_tree=max_tree)
        # The auto contestant's choices only change speed, never tokens: a flat stand-in curve will do.
        target.forward_curve = draft.forward_curve = ((1, 1.0), (max_tree + 1, 1.0))
        contestants = build_contestants(args, target, draft, t32.tokenizer, draft_dir, target_dir)
        runs = run_phase(prompts[: args.exactness], contestants, t32.tokenizer, SETTINGS, args.max_new_tokens,
                         args.seed, "exactness (float32)", memory=memory)  # fmt: skip
        exact = check_exactness(runs, {c.name: c.family for c in contestants})
        del target, draft, t32, d32, contestants
    tl = load_target(target_dir, dtype=args.dtype, device=args.device, plan=plan)
    dl = load_model(
        draft_dir,
        dtype=draft_dtype(args.dtype, args.draft_quantize),
        device=args.device,
        quantize=args.draft_quantize,
    )
    target, draft = TargetEngine(tl, max_tree=max_tree), DraftEngine(dl, max_tree=max_tree)
    if args.compile:
        from common.model.compiled_forward import compile_model

        for model in (tl.model, dl.model):
            compile_model(model, args.compile_buckets)
    if args.auto:
        target.profile()
        draft.profile()
    contestants = build_contestants(args, target, draft, tl.tokenizer, draft_dir, target_dir)
    if args.compile:
        contestants = compiled_twins(contestants, [tl.model, dl.model])
    if args.hf:
        contestants += hf_contestants(draft_dir, target_dir, tl.model.dtype, args.device, plan is not None)
    nodes = None
    if args.grpc:
        from client.remote import connect

        nodes = GrpcNodes(str(draft_dir), str(target_dir), args.dtype, max_tree, args.draft_quantize,
                          args.device, plan)  # fmt: skip
        b = args.grpc_budget
        params = TreeParams(
            budget=b, max_depth=args.max_depth, max_branch=args.max_branch, expand_batch=args.expand_batch
        )
        remote = connect(nodes.addrs["draft"], nodes.addrs["target"], tree=params)
        contestants.append(
            engine_contestant(f"specexec b={b} via gRPC", remote, family="grpc", processes=nodes.pids)
        )
    try:
        runs = run_phase(prompts, contestants, tl.tokenizer, settings, args.max_new_tokens, args.seed,
                         f"speed ({args.dtype})", args.repeat, memory)  # fmt: skip
    finally:
        node_rss = 0.0
        if nodes:
            try:
                node_rss = memory.life_peak_mb(nodes.pids)
            finally:
                nodes.close()
    families = {c.name: c.family for c in contestants}
    divergence = check_exactness([r for r in runs if r.setting == "greedy"], families)
    summary = summarize(runs, contestants)
    ranking = rank(runs)
    projection: list[dict] = []
    if args.target_cost_model:
        bandwidth = float(args.target_cost_model.split(":")[1]) if ":" in args.target_cost_model else 25.0
        cfg = tl.model.cfg  # an offloaded target streams its decoder layers every pass
        target_bytes = cfg.num_layers * cfg.layer_parameter_count * tl.model.dtype.itemsize
        projection = project(runs, contestants, target_bytes, bandwidth, args.per_token_ms)
    meta["peak_rss_mb"] = memory.life_peak_mb()
    meta["grpc_nodes_peak_rss_mb"] = node_rss
    raw = dict(meta=meta, runs=[r.__dict__ for r in runs], summary=summary, ranking=ranking, exactness=exact,
               bf16_divergence=divergence, projection=projection)  # fmt: skip
    (out / "results.json").write_text(json.dumps(raw, indent=1))
    report = write_report(out, meta, summary, ranking, exact, projection)
    plot(out, summary, projection)
    print(report)
    failures = [e for e in exact if e["first_divergence"] is not None]
    if failures:
        print(
            f"EXACTNESS FAILURE: {len(failures)} float32 runs differ from the target alone", file=sys.stderr
        )
        return 1
    return 0


def auto_cap(args: argparse.Namespace) -> int:
    return args.auto_cap or max(args.budgets)


def bench_settings(args: argparse.Namespace) -> list[str]:
    """The settings to time, in SETTINGS order; the float32 exactness pass always checks both."""
    chosen = set(args.settings or (["greedy", "sampled"] if args.sampled else ["greedy"]))
    return [name for name in SETTINGS if name in chosen]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_bench_parser(sub: Any) -> None:
    from common.options import add_offload_args

    b = sub.add_parser("bench", help="benchmark SpecExec against the baselines, with a report and plots")
    b.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    b.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    b.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:1, ...")
    add_offload_args(b)
    b.add_argument(
        "--draft-quantize",
        choices=QUANTIZE_CHOICES,
        default="none",
        help="our engine's draft in int8 (float32 elsewhere); Hugging Face's assistant stays --dtype",
    )
    b.add_argument(
        "--prompts", help="JSONL file with {'prompt', 'category'} per line (default: the shipped set)"
    )
    b.add_argument("--categories", nargs="+", help="only these categories (code, chat, prose)")
    b.add_argument("--limit", type=int, help="use the first N prompts (categories kept balanced)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 1024])
    b.add_argument("--chain", type=int, nargs="+", default=[2, 4, 8])
    b.add_argument(
        "--min-probs",
        type=float,
        nargs="+",
        default=[],
        help="also run every chain and budget expanding only nodes at least this probable",
    )
    b.add_argument(
        "--min-node-prob",
        type=float,
        default=0.0,
        help="also run every floored budget (--min-probs) proposing only nodes at least this probable",
    )
    b.add_argument("--max-depth", type=int, default=16)
    b.add_argument("--max-branch", type=int, default=8)
    b.add_argument("--expand-batch", type=int, default=16)
    b.add_argument("--no-auto", dest="auto", action="store_false", help="skip the --budget auto contestant")
    b.add_argument(
        "--auto-cap",
        type=positive_int,
        help="the largest tree auto may plan (default: the largest of --budgets)",
    )
    b.add_argument("--no-hf", dest="hf", action="store_false", help="skip the Hugging Face contestants")
    b.add_argument(
        "--no-grpc", dest="grpc", action="store_false", help="skip the two-process gRPC contestant"
    )
    b.add_argument("--grpc-budget", type=int, default=32)
    which = b.add_mutually_exclusive_group()
    which.add_argument(
        "--settings",
        nargs="+",
        choices=tuple(SETTINGS),
        help=f"decoding settings to time (default greedy; sampled is {SETTINGS['sampled']})",
    )
    which.add_argument("--sampled", action="store_true", help="short for --settings greedy sampled")
    b.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="speed runs per prompt, in separate passes over the prompt set; medians are over all runs",
    )
    b.add_argument("--exactness", type=int, default=2, help="prompts to check in float32 first (0: skip)")
    b.add_argument(
        "--target-cost-model", help="'bandwidth[:GBps]': project an offloaded target (default 25 GB/s)"
    )
    b.add_argument("--per-token-ms", type=float, default=0.05, help="modelled GPU compute per tree token")
    b.add_argument(
        "--compile",
        action="store_true",
        help="also run every engine contestant with both models compiled (see --compile-buckets)",
    )
    b.add_argument("--compile-buckets", type=parse_buckets, default=DEFAULT_BUCKETS, metavar="N,N,...")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=torch.get_num_threads())
    b.add_argument("--out", default="bench-results")
    b.set_defaults(func=cmd_bench)
