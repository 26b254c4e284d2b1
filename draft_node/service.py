"""DraftService: a thin adapter from protobuf requests to `DraftEngine`."""

from __future__ import annotations

import grpc

from common.ops.metrics import observe_step
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import rpc_method
from common.rpc.servicer import NodeServicer, client_key
from common.rpc.wire import grammar_from_proto, tree_params_from_proto, tree_to_proto
from common.runtime.sessions import StepTiming


class DraftServicer(NodeServicer, pb_grpc.DraftServiceServicer):
    role = "draft"

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
            grammar=grammar_from_proto(request.grammar) if request.HasField("grammar") else None,
        )
        observe_step("build_tree", request.session_id, request.step_id, timing, drafted.tree.size)
        return pb.BuildTreeResponse(
            tree=tree_to_proto(drafted.tree),
            draft_forwards=drafted.draft_forwards,
            build_seconds=timing.compute_seconds,
            queue_seconds=timing.queue_seconds,
            reused=drafted.reused,
        )
