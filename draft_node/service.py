"""DraftService: a thin adapter from protobuf requests to `DraftEngine`."""

from __future__ import annotations

import grpc

from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc import SERVER_VERSION, NotReady, rpc_method
from common.sessions import StepTiming
from common.wire import node_info_to_proto, tree_params_from_proto, tree_to_proto
from draft_node.engine import DraftEngine
from target_node.service import client_key


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self) -> None:
        self.engine: DraftEngine | None = None

    def attach(self, engine: DraftEngine, model_dir: object = None) -> None:
        self.engine = engine

    def _engine(self) -> DraftEngine:
        if self.engine is None:
            raise NotReady("the draft node is still loading its model")
        return self.engine

    @rpc_method
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        e = self._engine()
        return node_info_to_proto(e.info(), SERVER_VERSION, e.sessions.max_sessions, len(e.sessions))

    @rpc_method
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(
            session_id=self._engine().open_session(list(request.prompt), client_key(context))
        )

    @rpc_method
    def BuildTree(self, request: pb.BuildTreeRequest, context: grpc.ServicerContext) -> pb.BuildTreeResponse:
        e = self._engine()
        timing = StepTiming()
        drafted = e.build_tree(
            request.session_id,
            list(request.new_tokens),
            tree_params_from_proto(request.params),
            owner=client_key(context),
            truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
            step_id=request.step_id or None,
            timing=timing,
        )
        return pb.BuildTreeResponse(
            tree=tree_to_proto(drafted.tree),
            draft_forwards=drafted.draft_forwards,
            build_seconds=timing.compute_seconds,
            queue_seconds=timing.queue_seconds,
        )

    @rpc_method
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(
            closed=self._engine().close_session(request.session_id, client_key(context))
        )
