"""`specexec bench`'s harness: the contestants (our engine, Hugging Face, a pair of gRPC nodes), their
runs interleaved prompt by prompt so that drift in machine speed hits every contestant alike, the
untimed warm-up, and each run's memory. `measure` loads the models and runs both phases; the
statistics are `client.bench.stats`, the report `client.bench.report`, the flags `client.bench.cli`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.compiled_forward import DEFAULT_BUCKETS, compile_model
from common.model.loading import load_model
from common.model.offload import OffloadPlan, load_target
from common.model.quantized_linear import draft_dtype
from common.model.store import resolve_model
from common.ops.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from common.options import node_command, offload_flags
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.6, "top_p": 0.9}
SETTINGS = {"greedy": GREEDY, "sampled": SAMPLED}


@dataclass(frozen=True)
class BenchConfig:
    """What `specexec bench` measures: `client.bench.cli` builds one from its flags (same defaults)."""

    draft_model: str = "qwen2.5-coder-0.5b"
    target_model: str = "qwen2.5-coder-1.5b"
    dtype: str = "bfloat16"
    device: str = "cpu"
    offload: OffloadPlan | None = None
    draft_quantize: str = "none"  # our engine's draft only; Hugging Face's assistant stays `dtype`
    prompts: str | None = None  # a JSONL file; None: the shipped set
    categories: tuple[str, ...] | None = None
    limit: int | None = None
    max_new_tokens: int = 128
    budgets: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 1024)
    chain: tuple[int, ...] = (2, 4, 8)
    min_probs: tuple[float, ...] = ()
    min_node_prob: float = 0.0
    max_depth: int = 16
    max_branch: int = 8
    expand_batch: int = 16
    auto: bool = True
    auto_cap: int | None = None  # the largest tree auto may plan; None: the largest of `budgets`
    hf: bool = True
    grpc: bool = True
    grpc_budget: int = 32
    settings: tuple[str, ...] = ("greedy",)  # the settings to time; exactness always checks all
    repeat: int = 1
    exactness: int = 2  # prompts to check in float32 first (0: skip)
    compile: bool = False
    compile_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    seed: int = 0
    threads: int = field(default_factory=torch.get_num_threads)

    @property
    def auto_budget_cap(self) -> int:
        return self.auto_cap or max(self.budgets)

    @property
    def max_tree(self) -> int:
        """The largest tree any contestant drafts: the engines' capacity."""
        return max([*self.budgets, *self.chain, self.auto_budget_cap if self.auto else 1,
                    self.grpc_budget if self.grpc else 1])  # fmt: skip

    def tree(self, budget: int) -> TreeParams:
        return TreeParams(
            budget=budget,
            max_depth=self.max_depth,
            max_branch=self.max_branch,
            expand_batch=self.expand_batch,
        )


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


def families(contestants: list[Contestant]) -> dict[str, str]:
    return {c.name: c.family for c in contestants}


def load_prompts(
    path: str | None, limit: int | None, categories: Sequence[str] | None
) -> list[dict[str, str]]:
    """Our set (written for this project in the style of MT-Bench and OASST questions) or a user's JSONL."""
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"--prompts {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--prompts {path} is not UTF-8 text") from None
    else:
        lines = resources.files("client").joinpath("data/bench_prompts.jsonl").read_text().splitlines()
    prompts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompt file line {i + 1} is not JSON ({exc.msg})") from None
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or "prompt" not in p:
            raise ValueError(f"prompt file line {i + 1} has no 'prompt' field")
        p.setdefault("category", "other")
    if categories:
        known = sorted({p["category"] for p in prompts})
        prompts = [p for p in prompts if p["category"] in categories]
        if not prompts:
            raise ValueError(f"no prompt is in categories {', '.join(categories)}; the prompts' are {', '.join(known)}")
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


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one handed out before: nodes bind theirs only after start-up."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


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
        stop_processes(self.procs)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to all first (they shut down in parallel), then a kill for any still up after 30 s."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def build_contestants(config: BenchConfig, target: Any, draft: Any, tokenizer: Any) -> list[Contestant]:
    tree = config.tree(1)
    out = [engine_contestant("autoregressive", SpecExec(target, None, tokenizer, mode="autoregressive"))]
    for k in config.chain:
        out.append(
            engine_contestant(
                f"chain k={k}", SpecExec(target, draft, tokenizer, mode="chain", tree=TreeParams.chain(k))
            )
        )
    for b in config.budgets:
        out.append(
            engine_contestant(
                f"specexec b={b}", SpecExec(target, draft, tokenizer, tree=config.tree(b)), budget=b
            )
        )
    for p in config.min_probs:
        for k in config.chain:
            shape = TreeParams.chain(k, p)
            out.append(
                engine_contestant(
                    f"chain k={k} p={p:g}", SpecExec(target, draft, tokenizer, mode="chain", tree=shape)
                )
            )
        for b in config.budgets:
            for q in sorted({0.0, config.min_node_prob}):
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
    if config.auto:
        params = config.tree(config.auto_budget_cap)
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


def profiled_default_pair(max_tree: int = 64) -> tuple[TargetEngine, DraftEngine, Any]:
    """The default pair as the measured runs use it (bf16 target, int8 draft), each engine with its
    forward-time curve: (target engine, draft engine, tokenizer), for scripts that race variants."""
    target_model = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype="bfloat16")
    draft_model = load_model(
        resolve_model("qwen2.5-coder-0.5b"), dtype=draft_dtype("bfloat16", "int8"), quantize="int8"
    )
    target, draft = TargetEngine(target_model, max_tree=max_tree), DraftEngine(draft_model, max_tree=max_tree)
    target.profile()
    draft.profile()
    return target, draft, target_model.tokenizer


@dataclass
class Measured:
    """What `measure` ran: the speed phase's contestants and runs, and the float32 exactness phase's."""

    target: str  # the checkpoints' names
    draft: str
    prompts: int
    contestants: list[Contestant]
    runs: list[Run]
    exact_runs: list[Run]  # none where the exactness pass was skipped
    exact_families: dict[str, str]  # that pass's contestants' families, by name
    target_pass_bytes: int  # what an offloaded target streams every pass: its decoder layers
    peak_rss_scope: str  # "run", or "process so far" where the kernel cannot lower a peak (PeakMemory)
    peak_rss_mb: float  # this process's, over its life
    node_peak_rss_mb: float  # the gRPC nodes', over theirs (0 without them)


def measure(config: BenchConfig) -> Measured:
    """Load the pair, check exactness in float32 (`config.exactness` prompts), then time every
    contestant on every prompt in `config.dtype`."""
    torch.set_num_threads(config.threads)
    draft_dir, target_dir = resolve_model(config.draft_model), resolve_model(config.target_model)
    prompts = load_prompts(config.prompts, config.limit, config.categories)
    settings = {name: SETTINGS[name] for name in config.settings}
    max_tree, plan = config.max_tree, config.offload
    memory = PeakMemory(config.device)
    exact_runs: list[Run] = []
    exact_families: dict[str, str] = {}
    if config.exactness:
        # float32: batched tree passes and one-token passes then agree, so any divergence is a bug.
        t32 = load_target(target_dir, dtype="float32", device=config.device, plan=plan)
        d32 = load_model(draft_dir, dtype="float32", device=config.device, quantize=config.draft_quantize)
        target, draft = TargetEngine(t32, max_tree=max_tree), DraftEngine(d32, max_tree=max_tree)
        # The auto contestant's choices only change speed, never tokens: a flat stand-in curve will do.
        target.forward_curve = draft.forward_curve = ((1, 1.0), (max_tree + 1, 1.0))
        contestants = build_contestants(config, target, draft, t32.tokenizer)
        exact_runs = run_phase(prompts[: config.exactness], contestants, t32.tokenizer, SETTINGS,
                               config.max_new_tokens, config.seed, "exactness (float32)", memory=memory)  # fmt: skip
        exact_families = families(contestants)
        del target, draft, t32, d32, contestants
    tl = load_target(target_dir, dtype=config.dtype, device=config.device, plan=plan)
    dl = load_model(
        draft_dir,
        dtype=draft_dtype(config.dtype, config.draft_quantize),
        device=config.device,
        quantize=config.draft_quantize,
    )
    target, draft = TargetEngine(tl, max_tree=max_tree), DraftEngine(dl, max_tree=max_tree)
    if config.compile:
        for model in (tl.model, dl.model):
            compile_model(model, config.compile_buckets)
    if config.auto:
        target.profile()
        draft.profile()
    contestants = build_contestants(config, target, draft, tl.tokenizer)
    if config.compile:
        contestants = compiled_twins(contestants, [tl.model, dl.model])
    if config.hf:
        contestants += hf_contestants(draft_dir, target_dir, tl.model.dtype, config.device, plan is not None)
    nodes = None
    if config.grpc:
        nodes = GrpcNodes(str(draft_dir), str(target_dir), config.dtype, max_tree, config.draft_quantize,
                          config.device, plan)  # fmt: skip
        b = config.grpc_budget
        remote = connect(nodes.addrs["draft"], nodes.addrs["target"], tree=config.tree(b))
        contestants.append(
            engine_contestant(f"specexec b={b} via gRPC", remote, family="grpc", processes=nodes.pids)
        )
    try:
        runs = run_phase(prompts, contestants, tl.tokenizer, settings, config.max_new_tokens, config.seed,
                         f"speed ({config.dtype})", config.repeat, memory)  # fmt: skip
    finally:
        node_rss = 0.0
        if nodes:
            try:
                node_rss = memory.life_peak_mb(nodes.pids)
            finally:
                nodes.close()
    cfg = tl.model.cfg
    return Measured(
        target=target_dir.name,
        draft=draft_dir.name,
        prompts=len(prompts),
        contestants=contestants,
        runs=runs,
        exact_runs=exact_runs,
        exact_families=exact_families,
        target_pass_bytes=cfg.num_layers * cfg.layer_parameter_count * tl.model.dtype.itemsize,
        peak_rss_scope="run" if memory.per_run else "process so far",
        peak_rss_mb=memory.life_peak_mb(),
        node_peak_rss_mb=node_rss,
    )
