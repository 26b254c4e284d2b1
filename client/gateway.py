"""GenerationService: one endpoint that programs in any language call; it drives the two nodes."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from client.admission import Admission, QueueFull
from client.api import SpecExec, check_fits
from client.generation import GenerationStats
from common.decoding.tree import DEFAULT_CHAIN_LENGTH, TreeParams
from common.ops.metrics import track_generation
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import Server, abort_for, rpc_method
from common.rpc.wire import logprobs_to_proto, node_info_to_proto, sampling_from_proto, tree_params_from_proto

TARGET_HEALTH_EVERY = 5.0  # seconds between the gateway's health checks of its target node
RETRY_PUSHBACK = "grpc-retry-pushback-ms"  # a refusal past --max-queue: HTTP's Retry-After, for gRPC's retry policies


def follow_target(server: Server, gen: SpecExec, every: float = TARGET_HEALTH_EVERY) -> None:
    """The gateway's gRPC health follows its target node's, as its /health does; the draft is
    optional and never makes it NOT_SERVING. An in-process target needs no watching."""
    probe = getattr(gen.target, "serving", None)
    if probe is None:
        return

    def watch() -> None:
        while not server.stopped.wait(every):
            server.follow(probe() is None)

    threading.Thread(target=watch, daemon=True, name="target-health").start()


def stats_to_proto(s: GenerationStats) -> pb.GenerationStats:
    return pb.GenerationStats(
        new_tokens=s.new_tokens,
        target_steps=s.target_steps,
        tokens_per_step=s.tokens_per_step,
        tokens_per_second=s.tokens_per_second,
        wall_seconds=s.wall_seconds,
        draft_seconds=s.draft_seconds,
        target_seconds=s.target_seconds,
        network_seconds=s.network_seconds,
        cached_prompt_tokens=s.cached_prompt_tokens,
    )


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """`make_generator(mode, tree)` returns a SpecExec bound to the nodes (shared channels)."""

    def __init__(
        self, make_generator: Callable[..., SpecExec], base: SpecExec, admission: Admission | None = None
    ) -> None:
        """`admission`: the queue for the target's sessions, shared with an OpenAI endpoint (default:
        one of its own)."""
        self.make_generator = make_generator
        self.base = base
        self.admission = admission or Admission.for_target(base.target.info())

    @rpc_method
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.GatewayInfo:
        """The draft's part is the one the generator checked, and absent while the draft is down. What
        the gateway read when it connected: a node's version and open sessions are the node's to tell."""
        target = self.base.target.info()
        info = pb.GatewayInfo(target=node_info_to_proto(target, "", target.max_sessions, 0))
        draft = self.base.link.info if self.base.link is not None else None
        if draft is not None:
            info.draft.CopyFrom(node_info_to_proto(draft, "", draft.max_sessions, 0))
        return info

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        rid = request.request_id or secrets.token_hex(8)
        cancelled = threading.Event()
        if not context.add_callback(cancelled.set):
            cancelled.set()  # the call ended already
        try:
            sampling = sampling_from_proto(request.sampling)
            mode = request.mode if request.HasField("mode") else self.base.mode
            tree = tree_params_from_proto(request.tree, default=self.base.tree or TreeParams())
            if mode == "chain" and self.base.mode != "chain" and not request.tree.HasField("budget"):
                tree = replace(tree, budget=DEFAULT_CHAIN_LENGTH)  # the gateway's budget sizes trees, not chains
            generator = self.make_generator(mode, tree)
            prompt = request.text if request.WhichOneof("prompt") == "text" else list(request.token_ids.ids)
            prompt_ids = generator.encode(prompt)
            if request.sampling.HasField("max_new_tokens"):
                check_fits(len(prompt_ids), sampling.max_new_tokens, generator.target.info().max_context)
            ticket = self.admission.wait(cancelled.is_set)
            if ticket is None:
                return  # the client left while it waited
            with contextlib.ExitStack() as closing:
                closing.callback(self.admission.leave, ticket)  # after the stream: its sessions are closed
                stream = track_generation(
                    generator.stream(prompt_ids, sampling),
                    request_id=rid,
                    endpoint="grpc",
                    prompt_tokens=len(prompt_ids),
                    prompt=prompt,
                )
                closing.callback(stream.close)  # closes both nodes' sessions, however the call ends
                for chunk in stream:
                    if cancelled.is_set():
                        return
                    if chunk.finish_reason is None:
                        piece = pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                                 logprobs=logprobs_to_proto(chunk.logprobs),
                                                 prompt_logprobs=logprobs_to_proto(chunk.prompt_logprobs))  # fmt: skip
                        yield pb.GenerateResponse(request_id=rid, chunk=piece)
                        continue
                    if chunk.text:
                        yield pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(text=chunk.text))
                    assert chunk.stats is not None
                    final = pb.GenerateFinal(finish_reason=chunk.finish_reason, stats=stats_to_proto(chunk.stats))
                    yield pb.GenerateResponse(request_id=rid, final=final)
        except Exception as exc:
            if isinstance(exc, QueueFull):
                context.set_trailing_metadata(((RETRY_PUSHBACK, str(round(QueueFull.retry_after * 1000))),))
            abort_for(context, exc, "Generate")
