"""`specexec` command line: each subcommand is a thin layer over the Python API or a node server.

A node's subcommand loads only what the node needs (client.cli.nodes); every other one the whole
client (client.cli.commands)."""

from __future__ import annotations

import argparse
import sys

from client.cli.nodes import DESCRIPTION, NODE_COMMANDS, add_node_parser
from common.model.store import ModelStoreError
from common.ops import config
from common.ops.config import add_config_option
from common.ops.hugepages import reexec_with_huge_pages
from common.runtime.faults import NodeRefused


def build_parser() -> argparse.ArgumentParser:
    from client.cli.commands import build_parser as build_all

    return build_all()


def node_parser(role: str) -> argparse.ArgumentParser:
    """`specexec` with one node's subcommand: the same options, config tables and help."""
    parser = argparse.ArgumentParser(prog="specexec", description=DESCRIPTION)
    add_node_parser(parser.add_subparsers(dest="command", required=True), role)
    add_config_option(parser)
    return parser


def parser_for(command: str | None) -> argparse.ArgumentParser:
    """A node's own parser for a node's subcommand (it loads no client code), else the whole CLI's."""
    return node_parser(command) if command in NODE_COMMANDS else build_parser()


def subcommand(argv: list[str]) -> str | None:
    """The first word that is neither an option nor `--config`'s value."""
    words = iter(argv)
    for word in words:
        if word == "--config":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    """`argv` None: run as the `specexec` program, which first restarts itself with huge pages
    where they help (common.ops.hugepages)."""
    if argv is None:
        reexec_with_huge_pages()
    argv = sys.argv[1:] if argv is None else list(argv)
    role = subcommand(argv)
    parser = parser_for(role)
    try:
        args = config.parse_args(parser, argv)
    except config.ConfigError as exc:
        parser.error(str(exc))
    if role not in NODE_COMMANDS:
        from client.cli.commands import check_args

        check_args(parser, args)
    try:
        return int(args.func(args))
    except (ValueError, OSError, ModelStoreError) as exc:
        print(f"specexec: error: {exc}{config.source_of(str(exc), args)}", file=sys.stderr)
        return 2
    except NodeRefused as exc:
        print(f"specexec: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
