"""`specexec target` and `specexec draft`: a node's subcommand, parsed and served without the client's
modules, so that a target node on llama.cpp never imports torch (about 180 MiB of its RSS)."""

from __future__ import annotations

import argparse
from typing import Any

NODE_COMMANDS = ("target", "draft")
DESCRIPTION = ("Distributed speculative decoding (SpecExec): a draft node builds trees of likely "
               "continuations, a target node verifies each in one pass, and the client's output is the "
               "target's own. `specexec COMMAND --help` for a command's options.")
HELP = {
    "target": "serve a target model (the big one) over gRPC",
    "draft": "serve a draft model (the small one) over gRPC",
}


def add_node_parser(sub: Any, role: str) -> None:
    """`sub`: the root parser's subparsers."""
    parser = sub.add_parser(role, help=HELP[role])
    _server(role).build_parser(parser)
    parser.set_defaults(func=cmd_node)


def cmd_node(args: argparse.Namespace) -> int:
    from common.options import node_config
    from common.rpc.bootstrap import serve_node

    return serve_node(node_config(args), _server(args.command).ROLE)


def _server(role: str) -> Any:
    if role == "target":
        from target_node import server
    else:
        from draft_node import server  # type: ignore[no-redef]
    return server
