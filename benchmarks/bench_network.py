"""Per-step network cost of shipping a tree to the target node over loopback gRPC.

Measures, per tree size: encoding (TokenTree -> protobuf bytes), one Verify round trip to a server
that decodes and validates the tree exactly as the target node does (but runs no model), and the
decode + validate cost alone. Prints a markdown table; the forward-time column, if a model is given,
is one target forward over a tree of that size, for scale.

    .venv/bin/python -m benchmarks.bench_network [--target-model DIR] [--sizes 16 256 1024 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent import futures

import grpc
import torch

from common.decoding.tree import TokenTree
from common.model.loading import load_model
from common.model.store import resolve_model
from common.model.transformer import attention_bias
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import CHANNEL_OPTIONS, SERVER_OPTIONS
from common.rpc.wire import tree_from_proto, tree_to_proto

VOCAB = 151936


class DecodeOnlyTarget(pb_grpc.TargetServiceServicer):
    """The network path of a Verify without the model: parse the request and decode the tree."""

    def Verify(self, request, context):
        tree_from_proto(request.tree)
        return pb.VerifyResponse(tokens=[1, 2, 3], accepted=2)


def random_tree(n: int) -> TokenTree:
    g = torch.Generator().manual_seed(n)
    parents = torch.empty(n, dtype=torch.long)
    parents[0] = -1
    # A random recursive tree: bushy near the root, depth about e*ln(n), like best-first search output.
    for i in range(1, n):
        parents[i] = int(torch.randint(0, i, (1,), generator=g))
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    return TokenTree(tokens, parents, -torch.rand(n, generator=g).cumsum(0))


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024, 4096])
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--target-model", help="also time one target forward per tree size")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--forward-max", type=int, default=1024, help="largest tree to time a forward for")
    args = p.parse_args()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    pb_grpc.add_TargetServiceServicer_to_server(DecodeOnlyTarget(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    stub = pb_grpc.TargetServiceStub(channel)

    model = None
    if args.target_model:
        model = load_model(resolve_model(args.target_model), dtype=args.dtype).model

    print(
        f"| tree nodes | wire bytes | encode ms | network round trip ms (encode+transport+decode) |"
        f" validate+mask ms (target-side) |"
        f"{' target forward ms |' if model else ''}"
    )
    print("|---|---|---|---|---|" + ("---|" if model else ""))
    for n in args.sizes:
        tree = random_tree(n)
        msg = tree_to_proto(tree)
        request = pb.VerifyRequest(session_id="x", step_id=1, tree=msg, max_tokens=8)
        size = len(request.SerializeToString())
        encode = median_ms(
            lambda t=tree: pb.VerifyRequest(tree=tree_to_proto(t)).SerializeToString(), args.repeat
        )
        decode = median_ms(
            lambda m=msg: attention_bias(
                tree_from_proto(m).validate(vocab_size=VOCAB, max_nodes=1 << 16, max_depth=128).ancestors, 64
            ),
            args.repeat,
        )
        total = median_ms(
            lambda t=tree: stub.Verify(
                pb.VerifyRequest(session_id="x", step_id=1, tree=tree_to_proto(t), max_tokens=8)
            ),
            args.repeat,
        )
        row = f"| {n} | {size} | {encode:.3f} | {total:.3f} | {decode:.3f} |"
        if model is not None:
            forward = (
                median_ms(lambda t=tree: _forward(model, t), 2) if n <= args.forward_max else float("nan")
            )
            row += f" {forward:.1f} |"
        print(row, flush=True)
    server.stop(0)


def _forward(model, tree: TokenTree) -> None:
    structure = tree.validate(vocab_size=VOCAB, max_nodes=1 << 16, max_depth=128)
    cache = model.new_cache(tree.size + 64)
    model(
        tree.tokens,
        64 + structure.depths,
        torch.arange(64, 64 + tree.size),
        attention_bias(structure.ancestors, 64),
        cache,
    )


if __name__ == "__main__":
    main()
