"""`specexec target` / `python -m target_node`: serve a target model over gRPC."""

from __future__ import annotations

import argparse
import logging
import sys

from common.model.offload import add_offload_args, load_target, plan_from_args
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import add_node_args, engine_kwargs, serve_node
from target_node.engine import TargetEngine
from target_node.service import TargetServicer


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specexec target", description=__doc__)
    add_node_args(parser, default_port=50051)
    add_offload_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    return serve_node(
        args,
        "target",
        TargetServicer(),
        pb_grpc.add_TargetServiceServicer_to_server,
        "specexec.v1.TargetService",
        lambda loaded: TargetEngine(loaded, **engine_kwargs(args)),
        lambda args, path: load_target(
            path, dtype=args.dtype, device=args.device, repack=args.repack, plan=plan_from_args(args)
        ),
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(build_parser().parse_args(argv))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"target node: error: {exc}", file=sys.stderr)
        return 2
