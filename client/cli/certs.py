"""`specexec certs`: a private CA, server and client certificates and a token, for a home network."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.rpc.certs import generate, parse_hosts

MAX_DAYS = 100 * 365


def add_certs_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for the certificates, keys and token")
    parser.add_argument(
        "--hosts",
        required=True,
        help="comma-separated DNS names and IP addresses of the machines that run nodes or the gateway "
        "(localhost, 127.0.0.1 and ::1 are always added)",
    )
    parser.add_argument("--days", type=int, default=825, help="validity of every certificate (default 825)")
    parser.add_argument("--force", action="store_true", help="replace files already in --out")


def cmd_certs(args: argparse.Namespace) -> int:
    if not 1 <= args.days <= MAX_DAYS:  # X.509 dates end in 9999
        raise ValueError(f"--days must be in [1, {MAX_DAYS}], got {args.days}")
    issued = generate(Path(args.out), parse_hosts(args.hosts), days=args.days, force=args.force)
    out = Path(args.out)
    print(
        f"wrote a CA, {len(issued.servers)} server certificate(s), a client certificate and a token to {out}"
    )
    host, (cert, key) = next(iter(issued.servers.items()))
    ca, ccert, ckey, token = issued.ca, *issued.client, issued.token
    print(
        "copy ca.pem and token to every machine, each server-HOST(-key).pem to its host; keep ca-key.pem "
        "offline\n"
        f"  on {host}:  specexec target --model MODEL --listen 0.0.0.0:50051 --tls-cert {cert} --tls-key {key} "
        f"--tls-client-ca {ca} --auth-token-file {token}\n"
        f"  clients:  specexec generate --target {host}:50051 --draft HOST:50052 --node-tls-ca {ca} "
        f"--node-tls-cert {ccert} --node-tls-key {ckey} --node-auth-token-file {token} --prompt '...'",
        file=sys.stderr,
    )
    return 0
