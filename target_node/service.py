"""TargetService: a thin adapter from protobuf requests to `TargetEngine`."""

from __future__ import annotations

import grpc

from common.ops.metrics import observe_step
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import rpc_method
from common.rpc.servicer import NodeServicer, client_key
from common.rpc.wire import sampling_from_proto, tree_from_proto
from common.runtime.sessions import StepTiming

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


class TargetServicer(NodeServicer, pb_grpc.TargetServiceServicer):
    role = "target"

    @rpc_method
    def GetTokenizer(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.TokenizerFiles:
        e = self._engine()
        assert self.model_dir is not None
        files = {
            n: (self.model_dir / n).read_bytes() for n in TOKENIZER_FILES if (self.model_dir / n).is_file()
        }
        return pb.TokenizerFiles(files=files, fingerprint=e.loaded.tokenizer_fingerprint)

    @rpc_method
    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        e = self._engine()
        tree = tree_from_proto(request.tree, max_nodes=e.max_tree + 1)
        sampling = sampling_from_proto(request.sampling)
        timing = StepTiming()
        result = e.verify(
            request.session_id,
            tree,
            sampling,
            request.max_tokens,
            owner=client_key(context),
            append=list(request.append),
            truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
            step_id=request.step_id or None,
            timing=timing,
            cancelled=lambda: not context.is_active(),
        )
        observe_step(
            "verify",
            request.session_id,
            request.step_id,
            timing,
            tree.size,
            model_name=e.loaded.name,
            accepted=result.accepted,
            tokens=len(result.tokens),
        )
        return pb.VerifyResponse(
            tokens=result.tokens,
            accepted=result.accepted,
            finish_reason=result.finish_reason or "",
            forward_seconds=timing.compute_seconds,
            queue_seconds=timing.queue_seconds,
            pass_sessions=result.pass_sessions,
            pass_tokens=result.pass_tokens,
        )
