"""DraftService: a thin adapter from protobuf requests to `DraftEngine`."""

from __future__ import annotations

import logging

import grpc

from common.decoding.grammar import Grammar, GrammarError
from common.ops.metrics import observe_step
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import rpc_method
from common.rpc.servicer import NodeServicer, client_key
from common.rpc.wire import grammar_from_proto, tree_params_from_proto, tree_to_proto
from common.runtime.sessions import StepTiming

log = logging.getLogger(__name__)


class DraftServicer(NodeServicer, pb_grpc.DraftServiceServicer):
    role = "draft"

    @staticmethod
    def _grammar(request: pb.BuildTreeRequest) -> Grammar | None:
        """The request's grammar; one this node cannot read (a kind from a newer client) is left
        out, not refused: the draft only proposes, and the target applies the grammar itself."""
        if not request.HasField("grammar"):
            return None
        try:
            return grammar_from_proto(request.grammar)
        except GrammarError as exc:
            log.info("building trees without the request's grammar: %s", exc)
            return None

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
            grammar=self._grammar(request),
        )
        observe_step("build_tree", request.session_id, request.step_id, timing, drafted.tree.size)
        return pb.BuildTreeResponse(
            tree=tree_to_proto(drafted.tree),
            draft_forwards=drafted.draft_forwards,
            build_seconds=timing.compute_seconds,
            queue_seconds=timing.queue_seconds,
            reused=drafted.reused,
        )
