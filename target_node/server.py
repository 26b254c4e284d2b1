"""`specexec target` / `python -m target_node`: serve a target model over gRPC."""

from __future__ import annotations

import argparse

from common.options import add_kv_cache_arg, add_node_args, add_offload_args, add_regroup_arg, node_main
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.bootstrap import NodeRole
from target_node.engine import TargetEngine
from target_node.service import TargetServicer

ROLE = NodeRole(
    "target",
    TargetEngine,
    TargetServicer,
    pb_grpc.add_TargetServiceServicer_to_server,
    "specexec.v1.TargetService",
    engine_options=lambda config: {
        "kv_cache_tokens": config.kv_cache_tokens,
        "share_prefixes": config.share_prefixes,
        "regroup": config.batch_regroup_ms / 1000,
        **config.batching(),
    },
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specexec target", description=__doc__)
    add_node_args(parser, default_port=50051)
    add_offload_args(parser)
    add_kv_cache_arg(parser, "two sessions' worth, 2 x (--max-context + --max-tree + 1)")
    add_regroup_arg(parser, "for the other sessions running on the target alone (a Decode call) to queue their next pass")
    return parser


def main(argv: list[str] | None = None) -> int:
    return node_main(ROLE, build_parser, argv)
