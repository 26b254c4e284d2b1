"""TargetService: a thin adapter from protobuf requests to `TargetEngine`."""

from __future__ import annotations

from pathlib import Path

import grpc

from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc import SERVER_VERSION, NotReady, rpc_method
from common.sessions import StepTiming
from common.wire import node_info_to_proto, sampling_from_proto, tree_from_proto
from target_node.engine import TargetEngine

CLIENT_KEY = "x-specexec-client"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def client_key(context: grpc.ServicerContext) -> str:
    """Sessions belong to the client key that opened them: a session id alone grants nothing."""
    return dict(context.invocation_metadata()).get(CLIENT_KEY, "")


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self) -> None:
        self.engine: TargetEngine | None = None
        self.model_dir: Path | None = None

    def attach(self, engine: TargetEngine, model_dir: Path) -> None:
        self.engine, self.model_dir = engine, model_dir

    def _engine(self) -> TargetEngine:
        if self.engine is None:
            raise NotReady("the target node is still loading its model")
        return self.engine

    @rpc_method
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        e = self._engine()
        return node_info_to_proto(e.info(), SERVER_VERSION, e.sessions.max_sessions, len(e.sessions))

    @rpc_method
    def GetTokenizer(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.TokenizerFiles:
        e = self._engine()
        assert self.model_dir is not None
        files = {
            n: (self.model_dir / n).read_bytes() for n in TOKENIZER_FILES if (self.model_dir / n).is_file()
        }
        return pb.TokenizerFiles(files=files, fingerprint=e.loaded.tokenizer_fingerprint)

    @rpc_method
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        sid = self._engine().open_session(list(request.prompt), owner=client_key(context))
        return pb.OpenSessionResponse(session_id=sid)

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
        )
        return pb.VerifyResponse(
            tokens=result.tokens,
            accepted=result.accepted,
            finish_reason=result.finish_reason or "",
            forward_seconds=timing.compute_seconds,
            queue_seconds=timing.queue_seconds,
        )

    @rpc_method
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(
            closed=self._engine().close_session(request.session_id, client_key(context))
        )
