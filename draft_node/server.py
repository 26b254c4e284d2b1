"""`specexec draft` / `python -m draft_node`: serve a draft model over gRPC."""

from __future__ import annotations

import argparse

from common.options import add_kv_cache_arg, add_node_args, add_quantize_arg, add_regroup_arg, node_main
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.bootstrap import NodeRole
from draft_node.engine import DraftEngine
from draft_node.service import DraftServicer

ROLE = NodeRole(
    "draft",
    DraftEngine,
    DraftServicer,
    pb_grpc.add_DraftServiceServicer_to_server,
    "specexec.v1.DraftService",
    engine_options=lambda config: {
        "lookahead": config.lookahead,
        "regroup": config.batch_regroup_ms / 1000,
        "kv_cache_tokens": config.kv_cache_tokens,
        "share_prefixes": config.share_prefixes,
        **config.batching(),
    },
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specexec draft", description=__doc__)
    add_node_args(parser, default_port=50052)
    add_quantize_arg(parser)
    add_kv_cache_arg(parser, "two sessions' worth, 2 x (--max-context + its search's nodes + 1)")
    parser.add_argument(
        "--no-lookahead",
        dest="lookahead",
        action="store_false",
        help="do not grow the next tree while the target verifies (for a draft sharing the target's "
        "cores, where that work would slow the target down)",
    )
    add_regroup_arg(parser, "for the other sessions building a tree to choose their next expansion")
    return parser


def main(argv: list[str] | None = None) -> int:
    return node_main(ROLE, build_parser, argv)
