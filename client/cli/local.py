"""`specexec local`: a draft node and a target node on loopback, as two processes, for one machine."""

from __future__ import annotations

import argparse
import ctypes
import shlex
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import valid_text
from client.cli.args import auto_budget, planner_dir, prompt_ids, sampling_from, tree_from
from client.cli.output import print_stream
from client.remote import connect, open_channel
from common.model.llama_cpp import MAX_TREE_LEAVES, tree_limit
from common.options import node_command
from common.rpc.security import ClientSecurity
from common.runtime.sessions import DEFAULT_MAX_SESSIONS

SERVER_SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")


def client_security_args(args: argparse.Namespace) -> list[str]:
    """What another client needs to reach these nodes: the CA, its certificate, the nodes' token."""
    flags = (("--node-tls-ca", args.node_tls_ca), ("--node-tls-cert", args.node_tls_cert),
             ("--node-tls-key", args.node_tls_key), ("--node-auth-token-file", args.auth_token_file))  # fmt: skip
    return [item for flag, value in flags if value for item in (flag, str(value))]


def node_commands(args: argparse.Namespace, security_args: list[str]) -> list[list[str]]:
    """The target node's command, then the draft node's."""
    budget = tree_from(args).budget
    extra = security_args
    if args.compile:
        extra = [*extra, "--compile", "--compile-buckets", ",".join(map(str, args.compile_buckets))]
    target_extra = [*extra, "--backend", args.target_backend]
    if args.target_n_gpu_layers:
        target_extra += ["--n-gpu-layers", str(args.target_n_gpu_layers)]
    # llama.cpp (chosen by "auto" for a GGUF) takes at most 255 tree nodes besides the root, and
    # fewer where the node's sessions are to share passes (`specexec serve` on these nodes).
    target_budget = budget if args.target_backend == "torch" else min(budget, tree_limit(DEFAULT_MAX_SESSIONS))
    draft_extra = [*extra, "--backend", args.draft_backend]
    if args.draft_n_gpu_layers:
        draft_extra += ["--n-gpu-layers", str(args.draft_n_gpu_layers)]
    draft_budget = budget if args.draft_backend == "torch" else min(budget, MAX_TREE_LEAVES)
    return [
        node_command("target", args.target_model, args.target_port, args.dtype, target_budget, target_extra),
        node_command(
            "draft", args.draft_model, args.draft_port, args.dtype, draft_budget, draft_extra, args.draft_quantize
        ),
    ]


def check_ports(ports: dict[str, int]) -> None:
    """Each port free before a node is started on it: a node that cannot bind exits, but the client
    polling that address would find whatever holds it serving and use that (another `specexec
    local`'s node, with another model)."""
    if len(set(ports.values())) < len(ports):
        raise ValueError(f"--target-port and --draft-port must differ, got {ports['target']} for both")
    for role, port in ports.items():
        if not 1 <= port <= 65535:
            raise ValueError(f"--{role}-port must be in [1, 65535], got {port}")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed node's TIME_WAIT is no owner
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                raise OSError(f"--{role}-port {port}: 127.0.0.1:{port} is in use ({exc.strerror}; another "
                              f"specexec local?)") from None  # fmt: skip


def stop_with_parent() -> None:
    """In the node's process before it starts: SIGTERM when this command dies, even by SIGKILL or the
    OOM killer, which leave no `finally` to stop the nodes (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_ready(nodes: dict[str, tuple[subprocess.Popen, str]], security: ClientSecurity, timeout: float) -> None:
    """Both nodes load at once: the first to exit while starting is named at once, without waiting
    minutes for the other to load first."""
    deadline = time.monotonic() + timeout
    channels = {role: open_channel(address, security.channel_credentials()) for role, (_, address) in nodes.items()}
    try:
        waiting = {role: node for role, (node, _) in nodes.items()}
        while waiting:
            for role, (node, _) in nodes.items():  # one that served may die while the other loads
                if node.poll() is not None:
                    raise OSError(f"the {role} node exited while starting ({exit_status(node.returncode)}; "
                                  f"its error is above)")  # fmt: skip
            for role in list(waiting):
                try:
                    answer = health_pb2_grpc.HealthStub(channels[role]).Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    answer = None  # not listening yet
                if answer is not None and answer.status == health_pb2.HealthCheckResponse.SERVING:
                    del waiting[role]
            if waiting and time.monotonic() > deadline:
                late = " and ".join(waiting) + (" nodes were" if len(waiting) > 1 else " node was")
                raise OSError(f"the {late} not serving after {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        for channel in channels.values():
            channel.close()


def exit_status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def watch(nodes: dict[str, subprocess.Popen]) -> int:
    """Without --prompt the nodes serve until one exits (1, saying which) or this command is asked to
    stop (0, as the servers do)."""
    try:
        while True:
            for role, node in nodes.items():
                if node.poll() is not None:
                    print(f"specexec local: the {role} node exited ({exit_status(node.returncode)}); stopping "
                          "the other", file=sys.stderr)  # fmt: skip
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0


def run_local(args: argparse.Namespace) -> int:
    check_ports({"target": args.target_port, "draft": args.draft_port})
    sampling_from(args)  # a bad flag named before minutes of loading, with a prompt or not
    if args.prompt is not None:
        valid_text(args.prompt, "--prompt")
    # Serving, a requested stop exits 0 as the servers do; a generation cut short does not. Either
    # way the nodes are stopped below.
    status = 0 if args.prompt is None else 128 + signal.SIGTERM
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(status))
    target_addr, draft_addr = f"127.0.0.1:{args.target_port}", f"127.0.0.1:{args.draft_port}"
    # The nodes get this command's server flags; the client trusts --node-tls-ca, presents
    # --node-tls-cert/--node-tls-key and sends the nodes' own --auth-token-file.
    flags = [(f"--{name.replace('_', '-')}", getattr(args, name, None)) for name in SERVER_SECURITY_FLAGS]
    security_args = [item for flag, value in flags if value for item in (flag, value)]
    security = ClientSecurity.from_files(
        args.node_tls_ca, args.node_tls_cert, args.node_tls_key, args.auth_token_file
    )
    commands = node_commands(args, security_args)
    nodes = [subprocess.Popen(cmd, preexec_fn=stop_with_parent) for cmd in commands]
    try:
        wait_ready({"target": (nodes[0], target_addr), "draft": (nodes[1], draft_addr)}, security, timeout=600)
        client = " ".join(shlex.quote(item) for item in client_security_args(args))
        print(
            f"nodes ready: target {target_addr}, draft {draft_addr}\n"
            f"  specexec generate --target {target_addr} --draft {draft_addr}{' ' * bool(client)}{client} --prompt '...'\n"
            f"  specexec serve --target {target_addr} --draft {draft_addr}{' ' * bool(client)}{client}",
            file=sys.stderr,
            flush=True,
        )
        if args.prompt is None:
            return watch(dict(zip(("target", "draft"), nodes, strict=True)))
        gen = connect(
            draft_addr,
            target_addr,
            mode=args.mode,
            tree=tree_from(args),
            auto_budget=auto_budget(args),
            security=security,
            planner_dir=planner_dir(args),
        )
        return print_stream(gen.stream(prompt_ids(args, gen), sampling_from(args, gen.tokenizer)), args.json)
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=15)
            except subprocess.TimeoutExpired:
                node.kill()
