"""`specexec bench`: SpecExec against the baselines a user would pick, on the same models, prompts,
dtype, lengths and machine, interleaved prompt by prompt so that drift in machine speed hits every
contestant alike. Writes raw measurements (JSON), a markdown report and plots to `--out`.

The command line's edge: the flags become a `BenchConfig` here, and nothing below sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from client.bench import home_lab
from client.bench.harness import SETTINGS, BenchConfig, families, load_prompts, measure
from client.bench.home_lab import HomeLabConfig
from client.bench.report import plot, write_report
from client.bench.stats import check_exactness, project, rank, summarize
from common.model.compiled_forward import DEFAULT_BUCKETS, parse_buckets
from common.model.quantized_linear import QUANTIZE_CHOICES
from common.options import add_offload_args, non_negative_int, offload_plan, positive_int, probability, seed

DEFAULT_BANDWIDTH_GBPS = 25.0  # --target-cost-model bandwidth without a figure


def cmd_bench(args: argparse.Namespace) -> int:
    load_prompts(args.prompts, args.limit, args.categories)  # a bad prompt file or category, before any model loads
    if args.home_lab:
        return cmd_home_lab(args)
    if args.llama_cpp:
        return cmd_llama_cpp(args)
    if args.load:
        return cmd_load(args)
    config = bench_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = measure(config)
    runs, contestants = measured.runs, measured.contestants
    exact = check_exactness(measured.exact_runs, measured.exact_families)
    divergence = check_exactness([r for r in runs if r.setting == "greedy"], families(contestants))
    summary = summarize(runs, contestants)
    ranking = rank(runs)
    projection: list[dict] = []
    if args.target_cost_model:
        bandwidth = bandwidth_gbps(args.target_cost_model)
        projection = project(runs, contestants, measured.target_pass_bytes, bandwidth, args.per_token_ms)
    meta = dict(target=measured.target, draft=measured.draft, prompts=measured.prompts,
                max_new_tokens=config.max_new_tokens, dtype=config.dtype, threads=config.threads,
                command="specexec bench " + " ".join(sys.argv[2:]), projection=args.target_cost_model,
                draft_quantize=config.draft_quantize, settings=list(config.settings),
                auto_cap=config.auto_budget_cap if config.auto else None, device=config.device,
                offload=asdict(config.offload) if config.offload else None,
                peak_rss_scope=measured.peak_rss_scope, peak_rss_mb=measured.peak_rss_mb,
                grpc_nodes_peak_rss_mb=measured.node_peak_rss_mb)  # fmt: skip
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


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        draft_model=args.draft_model,
        target_model=args.target_model,
        dtype=args.dtype or "bfloat16",
        device=args.device,
        offload=offload_plan(args),
        draft_quantize=args.draft_quantize,
        prompts=args.prompts,
        categories=tuple(args.categories) if args.categories else None,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        budgets=tuple(args.budgets),
        chain=tuple(args.chain),
        min_probs=tuple(args.min_probs),
        min_node_prob=args.min_node_prob,
        max_depth=args.max_depth,
        max_branch=args.max_branch,
        expand_batch=args.expand_batch,
        auto=args.auto,
        auto_cap=args.auto_cap,
        hf=args.hf,
        grpc=args.grpc,
        grpc_budget=args.grpc_budget,
        settings=bench_settings(args),
        repeat=args.repeat,
        exactness=args.exactness,
        compile=args.compile,
        compile_buckets=tuple(args.compile_buckets),
        seed=args.seed,
        threads=args.threads,
    )


def bench_settings(args: argparse.Namespace) -> tuple[str, ...]:
    """The settings to time, in SETTINGS order; the float32 exactness pass always checks both."""
    chosen = set(args.settings or (["greedy", "sampled"] if args.sampled else ["greedy"]))
    return tuple(name for name in SETTINGS if name in chosen)


def bandwidth_gbps(cost_model: str) -> float:
    """'bandwidth[:GBps]' -> GB/s."""
    return float(cost_model.split(":")[1]) if ":" in cost_model else DEFAULT_BANDWIDTH_GBPS


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmark SpecExec against the baselines, with a report and plots")
    b.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    b.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    b.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="the models' dtype (default bfloat16; float32 for --load, whose batching is exact in it)",
    )
    b.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:1, ...")
    add_offload_args(b)
    b.add_argument(
        "--draft-quantize",
        choices=QUANTIZE_CHOICES,
        default="none",
        help="our engine's draft in int8 or int4 (float32 elsewhere); Hugging Face's assistant stays --dtype",
    )
    b.add_argument(
        "--prompts", help="JSONL file with {'prompt', 'category'} per line (default: the shipped set)"
    )
    b.add_argument("--categories", nargs="+", help="only these categories (code, chat, prose)")
    b.add_argument("--limit", type=positive_int, help="use the first N prompts (categories kept balanced)")
    b.add_argument("--max-new-tokens", type=positive_int, default=128)
    b.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 1024])
    b.add_argument("--chain", type=positive_int, nargs="+", default=[2, 4, 8])
    b.add_argument(
        "--min-probs",
        type=probability,
        nargs="+",
        default=[],
        help="also run every chain and budget expanding only nodes at least this probable",
    )
    b.add_argument(
        "--min-node-prob",
        type=probability,
        default=0.0,
        help="also run every floored budget (--min-probs) proposing only nodes at least this probable",
    )
    b.add_argument("--max-depth", type=positive_int, default=16)
    b.add_argument("--max-branch", type=positive_int, default=8)
    b.add_argument("--expand-batch", type=positive_int, default=16)
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
    b.add_argument("--grpc-budget", type=positive_int, default=32)
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
    b.add_argument("--exactness", type=non_negative_int, default=2, help="prompts to check in float32 first (0: skip)")
    b.add_argument(
        "--target-cost-model", help="'bandwidth[:GBps]': project an offloaded target (default 25 GB/s)"
    )
    b.add_argument("--per-token-ms", type=non_negative_float, default=0.05, help="modelled GPU compute per tree token")
    b.add_argument(
        "--compile",
        action="store_true",
        help="also run every engine contestant with both models compiled (see --compile-buckets)",
    )
    b.add_argument("--compile-buckets", type=parse_buckets, default=DEFAULT_BUCKETS, metavar="N,N,...")
    b.add_argument("--seed", type=seed, default=0)
    b.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="torch threads in this process")
    b.add_argument("--out", default="bench-results")
    b.add_argument(
        "--llama-cpp",
        action="store_true",
        help="time the llama.cpp backend against llama.cpp itself and the torch backend on the target's "
        "GGUF (specexec models install NAME --format gguf), with both backends' forward-time curves",
    )
    lab = b.add_argument_group("home lab (two machines emulated: each node pinned to its own cores)")
    lab.add_argument(
        "--home-lab",
        action="store_true",
        help="time the target alone, the sequential and the pipelined split and one process, with the "
        "nodes pinned to --draft-cores and --target-cores (one thread per core), --budget auto",
    )
    lab.add_argument(
        "--lab-backend",
        choices=("torch", "llama.cpp"),
        default="torch",
        help="both models' backend in the home lab (llama.cpp: their GGUF files, installed with --format gguf)",
    )
    lab.add_argument(
        "--lab-draft-backend",
        choices=("torch", "llama.cpp"),
        help="the draft's backend, where it differs from --lab-backend (torch: --draft-quantize applies)",
    )
    lab.add_argument("--draft-cores", type=cores, default=(0,), metavar="N,N,...")
    lab.add_argument("--target-cores", type=cores, default=(1,), metavar="N,N,...")
    lab.add_argument(
        "--rtt-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="round trip between the client (beside the draft) and the target node, added by a delaying "
        "relay: a home network's latency on loopback",
    )
    lab.add_argument(
        "--load",
        action="store_true",
        help="many users on one target: N concurrent streaming clients (--clients) through the OpenAI "
        "endpoint, the target batching their trees against one session per pass; chat prompts, float32",
    )
    lab.add_argument("--clients", type=positive_int, nargs="+", default=[1, 2, 4, 8], metavar="N")
    lab.add_argument(
        "--load-target-backend",
        choices=("torch", "llama.cpp"),
        default="torch",
        help="--load: the target node's backend (llama.cpp: its GGUF, installed with --format gguf)",
    )
    lab.add_argument(
        "--load-draft-backend",
        choices=("torch", "llama.cpp"),
        default="torch",
        help="--load: the draft node's backend (llama.cpp: its GGUF as it is; --draft-quantize is ignored)",
    )
    for role in ("target", "draft"):
        lab.add_argument(
            f"--load-{role}-n-gpu-layers",
            type=non_negative_int,
            default=0,
            metavar="N",
            help=f"--load: the {role} node's --n-gpu-layers (llama.cpp backend: layers on the GPU)",
        )
    b.set_defaults(func=cmd_bench)


def cores(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores must be integers separated by commas, got {text!r}") from None
    available = os.sched_getaffinity(0)
    if not values or not set(values) <= available:
        raise argparse.ArgumentTypeError(f"cores {text!r} are not all among this machine's {sorted(available)}")
    return values


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be in [0, 1000] ms, got {value:g}")
    return value


def pair_and_prompts(args: argparse.Namespace, dtype: str = "bfloat16") -> dict[str, Any]:
    """The models and prompts every bench mode takes from the same flags; `dtype` unless --dtype."""
    return dict(
        draft_model=args.draft_model,
        target_model=args.target_model,
        dtype=args.dtype or dtype,
        draft_quantize=args.draft_quantize,
        prompts=args.prompts,
        categories=tuple(args.categories) if args.categories else None,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
    )


def cmd_llama_cpp(args: argparse.Namespace) -> int:
    from client.bench import llama_cpp

    config = llama_cpp.LlamaBenchConfig(
        **pair_and_prompts(args),
        auto_cap=args.auto_cap or 64,
        threads=args.threads,
        out=Path(args.out),
    )
    result = llama_cpp.run(config)
    llama_cpp.write_report(result, config.out)
    print((config.out / "report.md").read_text())
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from client.bench import load

    pair = pair_and_prompts(args, dtype="float32")
    del pair["limit"]
    config = load.LoadConfig(
        **{**pair, "categories": pair["categories"] or ("chat",)},
        draft_cores=args.draft_cores,
        target_cores=args.target_cores,
        clients=tuple(sorted(set(args.clients))),
        max_budget=args.auto_cap or 64,
        target_backend=args.load_target_backend,
        draft_backend=args.load_draft_backend,
        target_n_gpu_layers=args.load_target_n_gpu_layers,
        draft_n_gpu_layers=args.load_draft_n_gpu_layers,
        out=Path(args.out),
    )
    if set(config.draft_cores) & set(config.target_cores):
        raise ValueError("--draft-cores and --target-cores must not share a core")
    runs, rounds = load.run(config)
    load.write_report(config.out, config, runs, load.summarize(runs, rounds))
    print((config.out / "report.md").read_text())
    return 0


def cmd_home_lab(args: argparse.Namespace) -> int:
    config = HomeLabConfig(
        **pair_and_prompts(args),
        draft_cores=args.draft_cores,
        target_cores=args.target_cores,
        max_budget=args.auto_cap or 256,
        settings=tuple(bench_settings(args)),
        seed=args.seed,
        rtt_ms=args.rtt_ms,
        backend=args.lab_backend,
        draft_backend=args.lab_draft_backend,
        out=Path(args.out),
    )
    if set(config.draft_cores) & set(config.target_cores):
        raise ValueError("--draft-cores and --target-cores must not share a core")
    runs = home_lab.run(config)
    rows = home_lab.summarize(runs)
    home_lab.write_report(config.out, config, runs, rows)
    print((config.out / "report.md").read_text())
    return 0
