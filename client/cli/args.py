"""The client commands' flags, and their conversion to the typed parameters the Python API takes."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from client import planner_state
from client.api import SpecExec, check_fits, render_chat
from client.dry import DEFAULT_BREAKERS, breaker_sequences, check_breakers
from client.generation import Recovery
from client.openai.server import TlsFiles
from client.remote import connect, wait_until_serving
from common.decoding.grammar import Grammar
from common.decoding.grammar import check as check_grammar
from common.decoding.penalties import Dry, Penalties
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DEFAULT_CHAIN_LENGTH, TreeParams
from common.model.llama_cpp import BACKENDS
from common.options import (
    DTYPES,
    add_backend_args,
    add_client_security_args,
    add_compile_args,
    add_offload_args,
    add_quantize_arg,
    add_repack_arg,
    client_security,
    compile_buckets,
    non_negative_float,
    non_negative_int,
    offload_plan,
    positive_float,
    positive_int,
)
from common.runtime.faults import NodeUnavailable


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, help="default 128; an ask that cannot fit after the prompt "
                   "is refused, the default is cut short where the context ends")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this times as probable as "
                   "the most probable one (vLLM's and llama.cpp's; 0: off)")
    g.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling's mass "
                   "(llama.cpp's; 1: off)")
    g.add_argument("--top-n-sigma", type=float, default=0.0, help="keep tokens within this many standard "
                   "deviations of the largest logit (llama.cpp's; 0: off)")
    g.add_argument("--xtc-probability", type=float, default=0.0, help="XTC: how often the most probable "
                   "tokens are taken out (llama.cpp's; 0: off)")
    g.add_argument("--xtc-threshold", type=float, default=0.1, help="XTC: tokens at least this probable are "
                   "taken out, all but the least probable of them")
    g.add_argument("--seed", type=int, default=0, help="seeded samples are identical to the target alone's")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, over prompt and output (1: off)")
    g.add_argument("--min-tokens", type=int, default=0, metavar="N", help="vLLM's: no EOS, stop token or stop "
                   "string ends the text before N tokens")
    g.add_argument("--repetition-window", type=int, default=0, metavar="N", help="the repetition penalty over "
                   "the context's last N tokens only (llama.cpp's --repeat-last-n); 0: all of them")
    g.add_argument("--dry-multiplier", type=float, default=0.0, help="DRY (llama.cpp's): how hard the token "
                   "that would extend a repeated sequence is pushed down; 0 (default): off")
    g.add_argument("--dry-base", type=float, default=1.75, help="DRY: the penalty grows by this factor a token")
    g.add_argument("--dry-allowed-length", type=int, default=2, metavar="N", help="DRY: repetitions up to N "
                   "tokens go free")
    g.add_argument("--dry-penalty-last-n", type=int, default=-1, metavar="N", help="DRY: over the context's "
                   "last N tokens; -1 (default): all of them; 0: off")
    g.add_argument("--dry-sequence-breaker", action="append", metavar="STRING", help="DRY: a repetition does "
                   "not reach back past this string (repeatable; replaces the defaults '\\n' ':' '\"' '*'; "
                   "'none': no breakers; \\n, \\t and \\\\ are read as llama.cpp reads them)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA", help="the text follows this JSON schema (JSON, or "
                       "@FILE); '{\"type\": \"object\"}': any JSON object")
    shape.add_argument("--regex", help="the text matches this regular expression")
    shape.add_argument("--grammar-file", type=Path, metavar="FILE", help="the text follows this GBNF (llama.cpp's) "
                       "or Lark grammar")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--mode", choices=("specexec", "chain", "autoregressive"), default="specexec")
    g.add_argument(
        "--budget",
        default="auto",
        help="tree nodes per step, or 'auto' (default): sized from the nodes' forward-time curves, up to "
        "--max-budget (chain mode: chain length, default 4); in process, a model's curve is measured once "
        "per machine (minutes on a CPU, then cached), which a number skips",
    )
    g.add_argument("--max-budget", type=positive_int, default=256, help="largest tree --budget auto considers")
    g.add_argument(
        "--no-planner-memory",
        action="store_true",
        help="--budget auto starts from nothing learned and keeps nothing; by default what it learns about a pair "
        "of nodes (whether trees pay, how fast steps run) is kept under ~/.cache/specexec/planner for the next run",
    )
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


def add_remote_args(p: argparse.ArgumentParser, *, in_process: bool) -> None:
    add_client_security_args(p)
    src = p.add_argument_group("nodes" + (" (remote) or models (in-process)" if in_process else ""))
    src.add_argument("--target", help="target node HOST:PORT")
    src.add_argument("--draft", help="draft node HOST:PORT")
    src.add_argument(
        "--step-timeout", type=positive_float, default=120.0, help="deadline of one draft or verify call (s)"
    )
    src.add_argument(
        "--draft-retry",
        type=non_negative_float,
        default=Recovery.draft_retry_seconds,
        help="seconds between attempts to reach a draft node that is down (the target generates alone "
        "meanwhile, with the same output)",
    )
    src.add_argument(
        "--wait-for-target",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the target node to serve (still loading its model, not started "
        "yet) instead of failing at once: for a target, draft and client started together",
    )
    if in_process:
        before = {action.dest for action in p._actions}
        src.add_argument("--target-model", help="target model: run both models in this process")
        src.add_argument("--draft-model", help="draft model (in-process mode)")
        p.add_argument("--dtype", choices=DTYPES, default="float32")
        p.add_argument("--device", default="cpu")
        add_backend_args(p)
        p.add_argument(
            "--draft-backend",
            choices=BACKENDS,
            default="auto",
            help="the draft model's backend, as --backend is the target's (auto: llama.cpp for a GGUF)",
        )
        p.add_argument(
            "--draft-n-gpu-layers",
            type=non_negative_int,
            default=0,
            metavar="N",
            help="llama.cpp draft: layers on the GPU (99: a small draft whole, beside a target streamed from RAM)",
        )
        add_repack_arg(p)
        add_compile_args(p)
        add_quantize_arg(p, "--draft-quantize")
        add_offload_args(p)
        # dest -> flag of the options that load models in this process: a run on nodes has no use for them
        p.in_process_only = {a.dest: a.option_strings[0] for a in p._actions  # type: ignore[attr-defined]
                             if a.dest not in before and a.dest != "target_model"}  # fmt: skip


def unused_model_flags(args: argparse.Namespace, sub: argparse.ArgumentParser) -> list[str]:
    """The in-process flags a run on nodes (--target) was given on its command line: a config file's
    and the environment's values are `sub`'s defaults by now, and may be meant for in-process runs."""
    flags = getattr(sub, "in_process_only", {})
    return [flag for dest, flag in flags.items() if getattr(args, dest, None) != sub.get_default(dest)]


T = TypeVar("T")


def sampling_from(args: argparse.Namespace, tokenizer: Any = None) -> SamplingParams:
    """The sampling flags as parameters. DRY's breakers are tokens of the model's vocabulary: without
    `tokenizer` (flags checked before any model is reached) it has none yet."""
    return by_flag(
        SamplingParams,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical_p,
        top_n_sigma=args.top_n_sigma,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        seed=args.seed,
        max_new_tokens=SamplingParams.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        grammar=grammar_from(args),
        penalties=penalties_from(args, tokenizer),
    )


def penalties_from(args: argparse.Namespace, tokenizer: Any = None) -> Penalties:
    """--presence-penalty, --frequency-penalty, --repetition-penalty, --repetition-window,
    --min-tokens and the --dry-* flags; a bad one named by its flag (Penalties' and Dry's errors start
    with the field's name, which is the flag's)."""
    try:
        return Penalties(presence=args.presence_penalty, frequency=args.frequency_penalty,
                         repetition=args.repetition_penalty, repetition_window=args.repetition_window,
                         min_tokens=args.min_tokens, dry=dry_from(args, tokenizer))  # fmt: skip
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        flag = "dry-sequence-breaker" if field == "dry_sequence_breakers" else field.replace("_", "-")
        raise ValueError(f"--{flag} {rest}") from None


def dry_from(args: argparse.Namespace, tokenizer: Any = None) -> Dry | None:
    """None when off (--dry-multiplier 0 or --dry-penalty-last-n 0), as llama.cpp reads them."""
    if getattr(args, "dry_multiplier", 0.0) == 0.0 or args.dry_penalty_last_n == 0:
        return None
    if args.dry_penalty_last_n < -1:
        raise ValueError(f"dry_penalty_last_n must be -1 (all of the context), 0 (off) or more, got "
                         f"{args.dry_penalty_last_n}")  # fmt: skip
    strings = DEFAULT_BREAKERS if args.dry_sequence_breaker is None else ()
    for given in args.dry_sequence_breaker or ():  # as llama.cpp reads them: "none" drops those before it
        strings = () if given == "none" else (*strings, unescape(given))
    breakers = breaker_sequences(tokenizer, strings) if tokenizer is not None else check_breakers(strings)
    return Dry(args.dry_multiplier, args.dry_base, args.dry_allowed_length, max(args.dry_penalty_last_n, 0),
               breakers)  # fmt: skip


def unescape(text: str) -> str:
    """llama.cpp's escapes in a flag's string: \\n, \\r, \\t, \\', \\", \\\\ and \\xNN."""
    return re.sub(r"\\(x[0-9a-fA-F]{2}|[nrt'\"\\])",
                  lambda m: chr(int(m[1][1:], 16)) if m[1][0] == "x" else _ESCAPES.get(m[1], m[1]), text)


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def grammar_from(args: argparse.Namespace) -> Grammar | None:
    """--json-schema, --regex or --grammar-file as a Grammar, checked here so that a bad one is named
    by its flag before any node is asked."""
    schema, regex, path = getattr(args, "json_schema", None), getattr(args, "regex", None), getattr(args, "grammar_file", None)
    flag, grammar = None, None
    try:
        if schema is not None:
            flag = "--json-schema"
            if schema.startswith("@"):
                schema = Path(schema[1:]).read_text()
            grammar = Grammar("json_schema", schema)
        elif regex is not None:
            flag, grammar = "--regex", Grammar("regex", regex)
        elif path is not None:
            flag = "--grammar-file"
            grammar = Grammar("gbnf", path.read_text())
        if grammar is not None:
            check_grammar(grammar)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return grammar


def by_flag(make: Callable[..., T], renamed: dict[str, str] | None = None, **fields: Any) -> T:
    """`make(**fields)`, with a bad value named by its flag (`--max-new-tokens`), not by the field
    it fills: the dataclasses' errors start with the field's name."""
    try:
        return make(**fields)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        if field in fields:
            flag = (renamed or {}).get(field, field).replace("_", "-")
            raise ValueError(f"--{flag} {rest}") from exc
        raise


def auto_budget(args: argparse.Namespace) -> bool:
    return args.budget == "auto" and args.mode == "specexec"


def planner_dir(args: argparse.Namespace) -> Path | None:
    return None if args.no_planner_memory else planner_state.default_dir()


def tree_from(args: argparse.Namespace) -> TreeParams:
    if args.budget == "auto":
        budget = args.max_budget if args.mode == "specexec" else DEFAULT_CHAIN_LENGTH
    else:
        try:
            budget = int(args.budget)
        except ValueError:
            raise ValueError(f"--budget must be a number or 'auto', got {args.budget!r}") from None
    return by_flag(
        TreeParams,
        {"budget": "max_budget"} if args.budget == "auto" else None,
        budget=budget,
        max_depth=args.max_depth,
        max_branch=args.max_branch,
        expand_batch=args.expand_batch,
        min_prob=args.min_prob,
        min_node_prob=args.min_node_prob,
    )


def prompt_from(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    """`--chat` renders the prompt as one user turn of the model's chat template (instruct models)."""
    if getattr(args, "chat", False):
        return render_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    return args.prompt


def prompt_ids(args: argparse.Namespace, gen: SpecExec) -> list[int]:
    """The prompt's ids; a --max-new-tokens given that cannot fit after them is refused, as the gateway
    and the OpenAI route refuse theirs."""
    ids = gen.encode(prompt_from(args, gen.tokenizer))
    if args.max_new_tokens is not None:
        check_fits(len(ids), args.max_new_tokens, gen.target.info().max_context, "--max-new-tokens")
    return ids


def generator_from(args: argparse.Namespace) -> SpecExec:
    """In-process models when --target-model is given, otherwise the remote nodes."""
    tree = tree_from(args)
    if getattr(args, "target_model", None):
        return SpecExec.local(
            args.draft_model,  # both resolved by `local`: a GGUF may run as it is, on llama.cpp
            args.target_model,
            dtype=args.dtype,
            device=args.device,
            repack=args.repack,
            offload=offload_plan(args),
            draft_quantize=args.draft_quantize,
            compile_buckets=compile_buckets(args),
            mode=args.mode,
            tree=tree,
            auto_budget=auto_budget(args),
            backend=args.backend,
            draft_backend=args.draft_backend,
            draft_n_gpu_layers=args.draft_n_gpu_layers,
            n_gpu_layers=args.n_gpu_layers,
            kv_type=args.kv_type,
            max_sessions=1,  # generate, chat and profile run one generation at a time
            planner_dir=planner_dir(args),
        )
    security = client_security(args)
    if args.wait_for_target:
        print(f"specexec: waiting up to {args.wait_for_target:g} s for the target node at {args.target}",
              file=sys.stderr)  # fmt: skip
        wait_until_serving(args.target, args.wait_for_target, security=security)
    try:
        return connect(
            args.draft if args.mode != "autoregressive" or args.command == "serve" else None,  # serve: per request
            args.target,
            mode=args.mode,
            tree=tree,
            auto_budget=auto_budget(args),
            step_timeout=args.step_timeout,
            security=security,
            recovery=Recovery(draft_retry_seconds=args.draft_retry),
            planner_dir=planner_dir(args),
        )
    except NodeUnavailable as exc:
        if args.wait_for_target or exc.timed_out or "--node-tls-ca" in str(exc):
            raise  # waiting would not help a node that hangs, or a TLS mismatch (its hint names the flag)
        raise NodeUnavailable(f"{exc} (--wait-for-target SECONDS waits for it)") from exc


def comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def add_openai_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI-compatible HTTP endpoint")
    g.add_argument(
        "--openai", metavar="HOST:PORT", help="also (or only) serve /v1/completions, /v1/chat/completions and "
        "Ollama's /api/chat, /api/generate (on 127.0.0.1:11434 it stands in for Ollama)"
    )
    g.add_argument("--served-model-name", help="the model id clients send (default: the target's model id)")
    g.add_argument(
        "--allowed-origins",
        type=comma_list,
        default=(),
        metavar="ORIGIN,...",
        help="browser origins besides this machine's (localhost) that may call the endpoint (CORS), "
        "e.g. https://chat.example.lan; * for any",
    )
    g.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=1024,
        help="chat max_tokens when a request omits it (completions: 16, as OpenAI)",
    )


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """HTTPS from the same --tls-cert/--tls-key (and --tls-client-ca) as the gRPC port."""
    cert = getattr(args, "tls_cert", None)
    if not cert:
        return None
    return TlsFiles(cert, getattr(args, "tls_key", None), getattr(args, "tls_client_ca", None) or None)
