"""The command-line edge shared by nodes and clients: argparse groups, and their conversion to the typed
settings the layers below take. No argparse namespace travels past this module."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import math
import sys
from collections.abc import Callable

from common.model.choices import DEFAULT_BUCKETS, QUANTIZE_CHOICES, OffloadPlan, draft_dtype, parse_buckets
from common.model.llama_cpp import BACKENDS
from common.ops.config import effective_config
from common.ops.logs import FORMATS, LEVELS, LogSettings
from common.rpc.bootstrap import EngineLimits, NodeConfig, NodeRole, serve_node
from common.rpc.security import ClientSecurity, ServerSecurity
from common.runtime.batching import DEFAULT_REGROUP, MAX_BATCH_TOKENS
from common.runtime.sessions import DEFAULT_EVICT_AFTER, DEFAULT_MAX_SESSIONS

DTYPES = ("float32", "bfloat16", "float16")

# ------------------------------------------------------------------------------------------------
# Argument groups


def add_node_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Options shared by `specexec draft` and `specexec target`."""
    parser.add_argument("--model", required=True, help="model directory, .gguf file or default-pair name")
    parser.add_argument("--listen", default=f"127.0.0.1:{default_port}",
                        help=f"HOST:PORT (default 127.0.0.1:{default_port}, loopback only)")  # fmt: skip
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    add_backend_args(parser)
    add_repack_arg(parser)
    add_compile_args(parser)
    parser.add_argument("--max-context", type=int, default=4096, help="tokens per session")
    parser.add_argument(
        "--max-tree",
        type=int,
        default=None,
        help="largest tree (nodes besides the root); default 1024, or on the llama.cpp backend 255, and on a "
        "llama.cpp target whose sessions share passes 256 minus --max-sessions (its 256 sequence ids, one per "
        "session and one per leaf in a shared pass; 255 where that would leave under 64)",
    )
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS)
    add_prefix_sharing_arg(parser)
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
        help="continuous batching: how long a pass waits for other sessions' work after the first arrives "
        "(default 0: work that arrives while a pass runs shares the next one)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=MAX_BATCH_TOKENS,
        help="rows one pass shared by sessions takes at most; a larger tree or chain still runs, alone; "
        f"1 gives each session's work a pass of its own (default {MAX_BATCH_TOKENS})",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="while other sessions are open, a pass runs at most N tokens of one session's prompt, so a long "
        "prompt takes several passes, each shared with the others' work, instead of stalling them all "
        "(default: the rows whose pass costs about 8 one-token passes on the node's measured curve, at "
        "least 64; a session alone takes 4 chunks a pass; never over --max-batch-tokens, or 64 if that is less)",
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=300.0, help="seconds before an idle session is freed"
    )
    parser.add_argument(
        "--evict-after",
        type=float,
        default=DEFAULT_EVICT_AFTER,
        metavar="SECONDS",
        help="at --max-sessions, a new session takes the place of the least recently used one idle this long "
        "(its client replays it on a fresh session if it comes back); 0 evicts any idle one, -1 refuses "
        f"the new session instead (default {DEFAULT_EVICT_AFTER:g})",
    )
    add_insecure_arg(parser)
    add_server_security_args(parser)
    add_metrics_args(parser)
    add_log_args(parser)
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip measuring the forward-time curve at start-up (clients then cannot use --budget auto)",
    )
    parser.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the forward-time curve even if this build's curve is cached from an earlier start",
    )


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="torch: our transformer (a GGUF is de-quantized once); llama.cpp: the GGUF as it is, quantized, "
        "through llama.cpp's kernels (needs llama-cpp-python); auto: llama.cpp for a model that is a GGUF "
        "when llama-cpp-python is installed, else torch",
    )
    parser.add_argument(
        "--n-gpu-layers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="llama.cpp backend: layers kept on the GPU (partial offload; needs a CUDA or Metal build)",
    )
    parser.add_argument(
        "--kv-type",
        choices=("f16", "f32", "q8_0", "q4_0"),
        default="f16",
        help="llama.cpp backend: the KV cache's type (f32 for exactness tests; q8_0 and q4_0 hold a "
        "long context in half or a quarter of f16's memory, with flash attention)",
    )


def add_repack_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-repack",
        dest="repack",
        action="store_false",
        help="keep bf16 CPU weights row-major instead of reordering them for oneDNN (slower; for comparison); "
        "on llama.cpp, skip its CPU repacking of quantized weights (less memory, slower tree passes)",
    )


def _int_at_least(text: str, low: int) -> int:
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {value}")
    return value


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return parse_buckets(text)
    except ValueError as e:  # argparse would replace the message with "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from e


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the forward pass per token-count bucket at start-up; "
        "off by default: on a CPU it measured 0-6%% faster per pass, -2 to +10%% per generation, after "
        "minutes of compilation on a cold cache (docs/history.md)",
    )
    parser.add_argument(
        "--compile-buckets",
        type=_buckets,
        default=DEFAULT_BUCKETS,
        metavar="N,N,...",
        help="with --compile: padded token counts, one graph each; larger passes run eagerly "
        f"(default {','.join(map(str, DEFAULT_BUCKETS))})",
    )


def add_quantize_arg(parser: argparse.ArgumentParser, flag: str = "--quantize") -> None:
    parser.add_argument(
        flag,
        choices=QUANTIZE_CHOICES,
        default="none",
        help="int8: int8 weights and dynamically quantized activations, float32 elsewhere, CPU only: "
        "up to 1.9x faster draft passes; int4: int4 weights for passes of up to 4 rows, int8 beyond; "
        "the output is still exactly the target's (default none)",
    )


def add_kv_cache_arg(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="llama.cpp backend: KV cells the sessions share; when they are full, the least recently used "
        f"session not at work gives its cells up and recomputes them at its next step (default: {default})",
    )


def add_prefix_sharing_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="compute every session's prompt in full; by default a new session takes the KV of the longest "
        "prompt prefix (a system prompt, a shared history) that an open session of the same client holds",
    )


def add_regroup_arg(parser: argparse.ArgumentParser, waits_for: str) -> None:
    parser.add_argument(
        "--batch-regroup-ms",
        type=float,
        default=DEFAULT_REGROUP * 1000,
        metavar="MS",
        help=f"continuous batching: how long a pass waits {waits_for} (default %(default)g; 0: the first "
        "ready runs alone)",
    )


def add_insecure_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --listen address without TLS and a token",
    )


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offload",
        action="store_true",
        help="keep decoder layers in host RAM and stream them to --device for every pass",
    )
    parser.add_argument(
        "--resident-layers",
        type=int,
        default=0,
        help="with --offload: keep the first N decoder layers on the device (default 0)",
    )
    parser.add_argument(
        "--prefetch-layers",
        type=int,
        default=2,
        help="with --offload: device buffers in the prefetch ring (default 2)",
    )


def add_server_security_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security (this server)")
    g.add_argument("--tls-cert", metavar="PATH", help="serve TLS: certificate chain (PEM)")
    g.add_argument("--tls-key", metavar="PATH", help="serve TLS: private key (PEM)")
    g.add_argument(
        "--tls-client-ca", metavar="PATH", help="require client certificates signed by this CA (mutual TLS)"
    )
    g.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="require 'authorization: Bearer <token>' on every call but health checks",
    )


def add_client_security_args(parser: argparse.ArgumentParser, token: bool = True) -> None:
    g = parser.add_argument_group("security (connections to nodes)")
    g.add_argument("--node-tls-ca", metavar="PATH", help="connect to nodes over TLS, trusting this CA (PEM)")
    g.add_argument("--node-tls-cert", metavar="PATH", help="client certificate for nodes that require one")
    g.add_argument("--node-tls-key", metavar="PATH", help="private key of --node-tls-cert")
    if token:
        g.add_argument(
            "--node-auth-token-file", metavar="PATH", help="the nodes' shared token (their --auth-token-file)"
        )


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to 127.0.0.1; off by default)",
    )


def add_log_args(parser: argparse.ArgumentParser, *, prompts: bool = False) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-format", choices=FORMATS, default="text", help="one line per event (default text)")
    g.add_argument("--log-level", choices=LEVELS, default="info")
    if prompts:
        g.add_argument(
            "--log-prompts",
            action="store_true",
            help="include prompt and completion text in request logs (off by default: logs never hold it)",
        )


# ------------------------------------------------------------------------------------------------
# Namespace -> typed settings


def server_security(args: argparse.Namespace) -> ServerSecurity:
    return ServerSecurity.from_files(
        getattr(args, "tls_cert", None),
        getattr(args, "tls_key", None),
        getattr(args, "tls_client_ca", None),
        getattr(args, "auth_token_file", None),
    )


def client_security(args: argparse.Namespace) -> ClientSecurity:
    return ClientSecurity.from_files(
        getattr(args, "node_tls_ca", None),
        getattr(args, "node_tls_cert", None),
        getattr(args, "node_tls_key", None),
        getattr(args, "node_auth_token_file", None),
    )


def offload_plan(args: argparse.Namespace) -> OffloadPlan | None:
    if not getattr(args, "offload", False):
        return None
    return OffloadPlan(resident_layers=args.resident_layers, prefetch_layers=args.prefetch_layers)


def compile_buckets(args: argparse.Namespace) -> tuple[int, ...] | None:
    return args.compile_buckets if getattr(args, "compile", False) else None


def log_settings(args: argparse.Namespace) -> LogSettings:
    return LogSettings(
        fmt=getattr(args, "log_format", "text"),
        level=getattr(args, "log_level", "info"),
        log_prompts=bool(getattr(args, "log_prompts", False)),
        startup=effective_config(args),
    )


def node_config(args: argparse.Namespace) -> NodeConfig:
    """Checked before the node binds its port or loads its model, so a bad flag is named at once."""
    for flag, value in (("--max-sessions", args.max_sessions), ("--max-context", args.max_context)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_tree is not None and args.max_tree < 1:
        raise ValueError(f"--max-tree must be >= 1, got {args.max_tree}")
    if not args.idle_timeout > 0:
        raise ValueError(f"--idle-timeout must be > 0 seconds, got {args.idle_timeout:g}")
    if not (args.evict_after >= 0 or args.evict_after == -1):  # nan too
        raise ValueError(f"--evict-after must be >= 0 seconds, or -1 to refuse new sessions; got {args.evict_after:g}")
    if not (math.isfinite(args.batch_window_ms) and args.batch_window_ms >= 0):
        raise ValueError(f"--batch-window-ms must be a finite number >= 0, got {args.batch_window_ms:g}")
    if args.max_batch_tokens < 1:
        raise ValueError(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")
    regroup_ms = getattr(args, "batch_regroup_ms", DEFAULT_REGROUP * 1000)
    if not (math.isfinite(regroup_ms) and regroup_ms >= 0):
        raise ValueError(f"--batch-regroup-ms must be a finite number >= 0, got {regroup_ms:g}")
    prefill_chunk = getattr(args, "prefill_chunk", None)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    return NodeConfig(
        model=args.model,
        listen=args.listen,
        dtype=args.dtype,
        device=args.device,
        repack=args.repack,
        quantize=getattr(args, "quantize", "none"),
        backend=args.backend,
        n_gpu_layers=args.n_gpu_layers,
        kv_type=args.kv_type,
        compile_buckets=compile_buckets(args),
        offload=offload_plan(args),
        limits=EngineLimits(args.max_context, args.max_tree, args.max_sessions, args.idle_timeout,
                            None if args.evict_after < 0 else args.evict_after),
        profile=args.profile,
        reprofile=args.reprofile,
        lookahead=getattr(args, "lookahead", False),
        batch_window_ms=args.batch_window_ms,
        max_batch_tokens=args.max_batch_tokens,
        kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
        batch_regroup_ms=regroup_ms,
        prefill_chunk=prefill_chunk,
        share_prefixes=args.prefix_sharing,
        insecure=args.insecure,
        security=server_security(args),
        metrics_port=args.metrics_port,
        log=log_settings(args),
    )


# ------------------------------------------------------------------------------------------------
# Node processes


def node_main(
    role: NodeRole, build_parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None
) -> int:
    """`python -m target_node` / `python -m draft_node`."""
    faulthandler.enable()  # a crash in native code (llama.cpp, torch) leaves the Python stacks in the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return serve_node(node_config(build_parser().parse_args(argv)), role)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"{role.name} node: error: {exc}", file=sys.stderr)
        return 2


def offload_flags(plan: OffloadPlan | None) -> list[str]:
    """The target node's command-line flags for `plan`: `offload_plan` read back."""
    if plan is None:
        return []
    return ["--offload", "--resident-layers", str(plan.resident_layers),
            "--prefetch-layers", str(plan.prefetch_layers)]  # fmt: skip


def node_command(
    role: str,
    model: str,
    port: int,
    dtype: str,
    max_tree: int,
    extra_args: list[str] | None = None,
    quantize: str = "none",
    lookahead: bool = False,
) -> list[str]:
    """A node's command line on loopback. An int8 draft runs its float parts in float32, whatever
    `dtype` says (its fastest on a CPU). Without `lookahead` a draft node only works when asked: on
    one machine its idle-time search would take cores from the target."""
    if role == "target" and quantize != "none":
        raise ValueError("only a draft node can be quantized")
    weights = ["--dtype", draft_dtype(dtype, quantize), *(["--quantize", quantize] if quantize != "none" else [])]
    return [
        sys.executable, "-m", f"{role}_node", "--model", model, "--listen", f"127.0.0.1:{port}", *weights,
        "--max-tree", str(max(max_tree, 1)),
        # The generated text shares this terminal: nodes report only warnings and errors.
        "--log-level", "warning",
        *(["--no-lookahead"] if role == "draft" and not lookahead else []),
        *(extra_args or []),
    ]  # fmt: skip

