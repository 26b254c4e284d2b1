"""Node pairs and OpenAI gateways on pinned cores, for the benchmarks that talk to the endpoint as a
chat client does (benchmarks/prompt_cache.py, benchmarks/prefix_sharing.py): the target on core 1,
the draft on core 0, one thread each, as in the home lab; gateways beside the draft."""

from __future__ import annotations

import argparse
import subprocess
import sys

from client.bench.harness import free_port
from client.bench.home_lab import model_dir, pinned
from client.bench.load import wait_http
from client.remote import wait_until_serving
from common.model.choices import QUANTIZE_CHOICES
from common.options import node_command


def add_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-quantize", default="int8", choices=QUANTIZE_CHOICES)
    parser.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"),
                        help="both nodes' (llama.cpp: the pair's GGUFs, installed with --format gguf)")  # fmt: skip
    parser.add_argument("--draft-backend", choices=("torch", "llama.cpp"), help="the draft's, if not --backend's "
                        "(the quickstart's pair: --backend llama.cpp --draft-backend torch)")  # fmt: skip


def start_nodes(
    args: argparse.Namespace, extra: list[str], procs: list[subprocess.Popen], per_role: dict[str, list[str]] | None = None
) -> dict[str, str]:
    """A target and a draft node with `extra` flags (and each role's `per_role`), ready: each one's
    address. Started processes are appended to `procs` (the caller stops them)."""
    addrs = {}
    for role, cores, quantize in (("target", (1,), "none"), ("draft", (0,), args.draft_quantize)):
        port = free_port()
        flags = [*extra, *(per_role or {}).get(role, [])]
        backend = args.backend if role == "target" else getattr(args, "draft_backend", None) or args.backend
        cmd = node_command(role, model_dir(getattr(args, f"{role}_model"), backend), port, args.dtype, 64,
                           ["--max-sessions", "8", "--backend", backend, *flags],
                           "none" if backend == "llama.cpp" else quantize, lookahead=True)  # fmt: skip
        argv, env = pinned(cmd, cores)
        procs.append(subprocess.Popen(argv, env=env))
        addrs[role] = f"127.0.0.1:{port}"
        wait_until_serving(addrs[role], timeout=1800, alive=lambda p=procs[-1]: p.poll() is None)
    return addrs


def start_gateway(addrs: dict[str, str], extra: list[str], procs: list[subprocess.Popen]) -> str:
    """`specexec serve --openai` over the nodes, `--budget auto`, with `extra` flags, ready: its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "client.cli.main", "serve", "--target", addrs["target"], "--draft", addrs["draft"],
           "--openai", f"127.0.0.1:{port}", "--budget", "auto", "--no-planner-memory", "--log-level", "warning",
           *extra]  # fmt: skip
    argv, env = pinned(cmd, (0,))
    procs.append(subprocess.Popen(argv, env=env))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", procs[-1])
    return url
