"""TargetService: a thin adapter from protobuf requests to `TargetEngine`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from common.decoding.types import VerifyResult
from common.ops.metrics import observe_step
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import abort_for, rpc_method
from common.rpc.servicer import NodeServicer, client_key
from common.rpc.wire import logprobs_to_proto, sampling_from_proto, tree_from_proto
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
            timing=timing,
            **_step_args(request, context),
        )
        self._observe(request.session_id, request.step_id, timing, tree.size, result, scored=sampling.score)
        return _response(result, timing)

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.VerifyResponse]:
        try:
            e, timing = self._engine(), StepTiming()
            results = e.decode(
                request.session_id,
                request.last_token,
                sampling_from_proto(request.sampling),
                request.max_tokens,
                request.steps,
                timing=timing,
                **_step_args(request, context),
            )
            for result in results:
                self._observe(request.session_id, request.step_id, timing, 1, result)
                yield _response(result, timing)
        except Exception as exc:
            abort_for(context, exc, "Decode")

    def _observe(self, session_id: str, step_id: int, timing: StepTiming, size: int, result: VerifyResult,
                 scored: bool = False) -> None:  # fmt: skip
        """A scoring step's chain is no draft: the acceptance metrics leave it out."""
        e = self._engine()
        observe_step("verify", session_id, step_id, timing, size, model_name=e.loaded.name,
                     accepted=None if scored else result.accepted, tokens=len(result.tokens))  # fmt: skip


def _step_args(request: pb.VerifyRequest | pb.DecodeRequest, context: grpc.ServicerContext) -> dict[str, Any]:
    """What Verify and Decode pass alike: the caller, the sequence's changes, the step, cancellation."""
    return {
        "owner": client_key(context),
        "append": list(request.append),
        "truncate_to": request.truncate_to if request.HasField("truncate_to") else None,
        "step_id": request.step_id or None,
        "cancelled": lambda: not context.is_active(),
    }


def _response(result: VerifyResult, timing: StepTiming) -> pb.VerifyResponse:
    return pb.VerifyResponse(
        tokens=result.tokens,
        accepted=result.accepted,
        finish_reason=result.finish_reason or "",
        forward_seconds=timing.compute_seconds,
        queue_seconds=timing.queue_seconds,
        pass_sessions=result.pass_sessions,
        pass_tokens=result.pass_tokens,
        cached_tokens=result.shared_tokens,
        logprobs=logprobs_to_proto(result.logprobs),
    )
