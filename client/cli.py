"""`specexec` command line: each subcommand is a thin layer over the Python API or a node server."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from common.sampling import SamplingParams
from draft_node.tree_builder import TreeParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="seeded samples are identical to the target alone's")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--mode", choices=("specexec", "chain", "autoregressive"), default="specexec")
    g.add_argument("--budget", type=int, default=64, help="tree nodes per step (chain mode: chain length)")
    g.add_argument("--max-depth", type=int, default=16)
    g.add_argument("--max-branch", type=int, default=8)
    g.add_argument("--expand-batch", type=int, default=16)


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def tree_from(args: argparse.Namespace) -> TreeParams:
    return TreeParams(
        budget=args.budget,
        max_depth=args.max_depth,
        max_branch=args.max_branch,
        expand_batch=args.expand_batch,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from client.api import SpecExec, collect

    sampling = sampling_from(args)
    tree = tree_from(args)
    if args.target_model:
        gen = SpecExec.local(
            args.draft_model,
            args.target_model,
            dtype=args.dtype,
            device=args.device,
            mode=args.mode,
            tree=tree,
        )
    else:
        from client.remote import connect

        gen = connect(args.draft, args.target, mode=args.mode, tree=tree)
    chunks = gen.stream(args.prompt, sampling)
    if args.json:
        print(json.dumps(collect(chunks).as_dict()))
        return 0
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.stats is not None:
            s = chunk.stats
            print(
                f"\n[{s.new_tokens} tokens, {s.tokens_per_second:.2f} tok/s, "
                f"{s.tokens_per_step:.2f} tokens/step, finish: {chunk.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    src = g.add_argument_group("models (in-process) or nodes (remote)")
    src.add_argument("--target-model", help="target model directory: run both models in this process")
    src.add_argument("--draft-model", help="draft model directory (in-process mode)")
    src.add_argument("--target", help="target node HOST:PORT")
    src.add_argument("--draft", help="draft node HOST:PORT")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(g)
    add_tree_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        if not args.target_model and not args.target:
            parser.error("generate needs --target-model PATH (in-process) or --target HOST:PORT")
        if args.target_model and args.mode != "autoregressive" and not args.draft_model:
            parser.error(f"--mode {args.mode} needs --draft-model (or use --mode autoregressive)")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specexec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
