"""`specexec draft` / `python -m draft_node`: serve a draft model over gRPC."""

from __future__ import annotations

import argparse
import logging
import sys

from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import add_node_args, add_quantize_arg, engine_kwargs, serve_node
from draft_node.engine import DraftEngine
from draft_node.service import DraftServicer


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specexec draft", description=__doc__)
    add_node_args(parser, default_port=50052)
    add_quantize_arg(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    return serve_node(
        args,
        "draft",
        DraftServicer(),
        pb_grpc.add_DraftServiceServicer_to_server,
        "specexec.v1.DraftService",
        lambda loaded: DraftEngine(loaded, **engine_kwargs(args)),
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(build_parser().parse_args(argv))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"draft node: error: {exc}", file=sys.stderr)
        return 2
