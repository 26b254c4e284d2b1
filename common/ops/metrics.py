"""Prometheus metrics for the nodes and the gateway (`--metrics-port [HOST:]PORT` serves /metrics).

Every gRPC server counts its requests through `RpcMetrics`, an interceptor; the node servicers report
each step with `observe_step`, and the gateway wraps each generation in `track_generation`.

Speculative-decoding counters follow vLLM's names (`vllm:spec_decode_*` -> `specexec:spec_decode_*`,
same labels `model_name` and `position`) so dashboards built for vLLM work with the prefix changed.
They are counted on the target, per Verify whose tree holds draft tokens (a "draft"):

    specexec:spec_decode_num_drafts_total                 Verify steps with at least one draft token
    specexec:spec_decode_num_draft_tokens_total           tree nodes besides the root
    specexec:spec_decode_num_accepted_tokens_total        tree tokens the target accepted
    specexec:spec_decode_num_accepted_tokens_per_pos_total{position="j"}
                                                          drafts whose accepted path reached depth j+1
    specexec:spec_decode_acceptance_length                histogram of tokens committed per draft
                                                          (accepted + the target's own token)

Mean acceptance length is 1 + accepted / drafts, as in vLLM. Acceptance *rate* (accepted / draft
tokens) is much lower for trees than for vLLM's chains by design: a tree spends many nodes on
alternatives so that one long path is likely to survive; judge trees by acceptance length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)

from common.ops import logs
from common.ops.logs import event

log = logging.getLogger("specexec.node")
gateway_log = logging.getLogger("specexec.gateway")

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 128)

# All servers
RPC_REQUESTS = Counter("specexec:rpc_requests", "gRPC requests by method and status code", ["method", "code"])
RPC_SECONDS = Histogram(
    "specexec:rpc_duration_seconds", "gRPC request latency at the server", ["method"], buckets=LATENCY_BUCKETS
)

# Nodes
NODE = Info("specexec:node", "the model this node serves")
OPEN_SESSIONS = Gauge("specexec:open_sessions", "sessions open on this node (each holds a KV cache)")
MAX_SESSIONS = Gauge("specexec:max_sessions", "the node's session limit (--max-sessions)")
SESSION_EVENTS = Counter(
    "specexec:session_events",
    "sessions opened, closed by their client, expired idle, or evicted at the session limit",
    ["event"],
)
PREEMPTIONS = Counter(
    "specexec:num_preemptions", "sessions whose KV cache was taken to make room (recomputed at their next step)"
)
STEP_QUEUE_SECONDS = Histogram(
    "specexec:step_queue_seconds", "time a step waited for the model", ["step"], buckets=LATENCY_BUCKETS
)
DRAFT_BUILD_SECONDS = Histogram(
    "specexec:draft_build_seconds",
    "draft: catch-up plus tree search of one BuildTree",
    buckets=LATENCY_BUCKETS,
)
TARGET_FORWARD_SECONDS = Histogram(
    "specexec:target_forward_seconds",
    "target: one Verify's forward pass over pending tokens and the tree, plus the acceptance walk",
    buckets=LATENCY_BUCKETS,
)
VERIFY_PASS_SESSIONS = Histogram(
    "specexec:verify_pass_sessions",
    "target: sessions whose trees shared one forward pass (continuous batching)",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
VERIFY_PASS_SECONDS = Histogram(
    "specexec:verify_pass_seconds",
    "target: one forward pass, shared or alone (its sum over a span of wall time: how busy the target was)",
    buckets=LATENCY_BUCKETS,
)
VERIFY_PASS_TOKENS = Histogram(
    "specexec:verify_pass_tree_tokens",
    "target: tree tokens (and prompt chunks') of all sessions in one forward pass",
    buckets=SIZE_BUCKETS,
)
PREFILL_CHUNKS = Counter(
    "specexec:prefill_chunks",
    "target: chunks of sessions' long prompts run ahead of their trees (chunked prefill; a pass may run several)",
)
PREFILL_CHUNK_TOKENS = Counter("specexec:prefill_chunk_tokens", "target: prompt tokens run in such chunks")
SESSION_PROMPT_TOKENS = Counter("specexec:session_prompt_tokens", "prompt tokens of the sessions opened", ["role"])
SESSION_SHARED_TOKENS = Counter(
    "specexec:session_shared_prompt_tokens",
    "prompt tokens whose KV a new session took from an open session's (prefix sharing) instead of computing",
    ["role"],
)
DRAFT_PASS_SESSIONS = Histogram(
    "specexec:draft_pass_sessions",
    "draft: sessions whose forwards (catch-up chains, expansion batches) shared one pass",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
DRAFT_PASS_SECONDS = Histogram(
    "specexec:draft_pass_seconds",
    "draft: one forward pass of requests' or idle work (its sum over a span of wall time: how busy the draft was)",
    buckets=LATENCY_BUCKETS,
)
DRAFT_PASS_TOKENS = Histogram(
    "specexec:draft_pass_tokens",
    "draft: tokens of all sessions in one forward pass",
    buckets=SIZE_BUCKETS,
)
TREE_NODES = Histogram("specexec:tree_nodes", "tree size including the root", ["step"], buckets=SIZE_BUCKETS)

# Target: vLLM-compatible speculative-decoding figures
SPEC_DRAFTS = Counter("specexec:spec_decode_num_drafts", "Verify steps with draft tokens", ["model_name"])
SPEC_DRAFT_TOKENS = Counter(
    "specexec:spec_decode_num_draft_tokens",
    "draft tokens verified (tree nodes besides the root)",
    ["model_name"],
)
SPEC_ACCEPTED = Counter(
    "specexec:spec_decode_num_accepted_tokens", "draft tokens accepted by the target", ["model_name"]
)
SPEC_ACCEPTED_PER_POS = Counter(
    "specexec:spec_decode_num_accepted_tokens_per_pos",
    "drafts whose accepted path reached depth position+1",
    ["model_name", "position"],
)
SPEC_ACCEPTANCE_LENGTH = Histogram(
    "specexec:spec_decode_acceptance_length",
    "tokens committed per draft: accepted tokens plus the target's own",
    ["model_name"],
    buckets=LENGTH_BUCKETS,
)

# Gateway (gRPC GenerationService and the OpenAI endpoint)
REQUESTS_RUNNING = Gauge("specexec:num_requests_running", "generations in progress")
REQUESTS_WAITING = Gauge(
    "specexec:num_requests_waiting", "requests queued for a slot: the target node's --max-sessions are all running"
)
QUEUE_SECONDS = Histogram(
    "specexec:request_queue_time_seconds", "time a request waited in the queue for a slot", buckets=LATENCY_BUCKETS
)
REQUEST_SUCCESS = Counter("specexec:request_success", "finished generations", ["finished_reason"])
PROMPT_TOKENS = Counter("specexec:prompt_tokens", "prompt tokens of finished and running generations")
GENERATION_TOKENS = Counter("specexec:generation_tokens", "tokens generated")
PREFIX_CACHE_QUERIES = Counter("specexec:prefix_cache_queries", "prompt tokens of the requests")
PREFIX_CACHE_HITS = Counter(
    "specexec:prefix_cache_hits",
    "prompt tokens of finished requests the target already held: a kept sequence's, or another session's (prefix sharing)",
)
E2E_SECONDS = Histogram(
    "specexec:e2e_request_latency_seconds", "generation time, first to last token", buckets=LATENCY_BUCKETS
)
TTFT_SECONDS = Histogram(
    "specexec:time_to_first_token_seconds", "time to the first generated token", buckets=LATENCY_BUCKETS
)
HTTP_REQUESTS = Counter("specexec:http_requests", "OpenAI-compatible HTTP requests", ["path", "code"])
HTTP_SECONDS = Histogram(
    "specexec:http_request_duration_seconds", "OpenAI-compatible HTTP request latency", ["path"],
    buckets=LATENCY_BUCKETS,
)  # fmt: skip


# What each role's /metrics serves: a node's gateway metrics (and a gateway's node ones) would be
# series stuck at zero on a dashboard.
_EVERY = (RPC_REQUESTS, RPC_SECONDS, PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
_NODES = (NODE, OPEN_SESSIONS, MAX_SESSIONS, SESSION_EVENTS, PREEMPTIONS, STEP_QUEUE_SECONDS, TREE_NODES,
          SESSION_PROMPT_TOKENS, SESSION_SHARED_TOKENS)  # fmt: skip
ROLE_METRICS = {
    "target": (*_EVERY, *_NODES, TARGET_FORWARD_SECONDS, VERIFY_PASS_SESSIONS, VERIFY_PASS_SECONDS, VERIFY_PASS_TOKENS,
               PREFILL_CHUNKS, PREFILL_CHUNK_TOKENS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED,
               SPEC_ACCEPTED_PER_POS, SPEC_ACCEPTANCE_LENGTH),
    "draft": (*_EVERY, *_NODES, DRAFT_BUILD_SECONDS, DRAFT_PASS_SESSIONS, DRAFT_PASS_SECONDS, DRAFT_PASS_TOKENS),
    "gateway": (*_EVERY, REQUESTS_RUNNING, REQUESTS_WAITING, QUEUE_SECONDS, REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_CACHE_QUERIES,
                PREFIX_CACHE_HITS, E2E_SECONDS, TTFT_SECONDS, HTTP_REQUESTS, HTTP_SECONDS),
}  # fmt: skip


def role_registry(role: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    for collector in ROLE_METRICS[role]:
        registry.register(collector)
    return registry


def parse_metrics_address(spec: str | int) -> tuple[str, int]:
    host, _, port = str(spec).rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--metrics-port must be PORT or HOST:PORT, got {spec!r}")
    if int(port) > 65535:
        raise ValueError(f"--metrics-port: the port must be in [0, 65535], got {port}")
    return host.strip("[]") or "127.0.0.1", int(port)


def start_metrics_server(spec: str | int | None, role: str | None = None) -> int | None:
    """Serve /metrics in a daemon thread if `--metrics-port` was given (`role`'s metrics only: "target",
    "draft" or "gateway"; None: all); returns the bound port."""
    if spec is None or spec == "":
        return None
    host, port = parse_metrics_address(spec)
    try:
        if role is None:
            server, _thread = start_http_server(port, addr=host)
        else:
            server, _thread = start_http_server(port, addr=host, registry=role_registry(role))
    except OSError as e:
        raise OSError(f"--metrics-port {spec}: could not bind {host}:{port} ({e.strerror or e})") from e
    bound = server.server_port
    event(log, "metrics_listening", address=f"{host}:{bound}", path="/metrics")
    return bound


# ------------------------------------------------------------------------------------------------
# Nodes


def track_engine(engine: Any) -> None:
    """Export the engine's model and live session count (read at scrape time)."""
    info = engine.info()
    NODE.info({"role": info.role, "model_name": info.model_id, "dtype": info.dtype, "device": info.device})
    OPEN_SESSIONS.set_function(lambda: len(engine.sessions))
    MAX_SESSIONS.set(engine.sessions.max_sessions)


def session_event(name: str, session: str, **fields: Any) -> None:
    """`name` is opened, closed, expired or evicted."""
    SESSION_EVENTS.labels(name).inc()
    event(log, f"session_{name}", session=session, **fields)


def observe_step(
    step: str,
    session: str,
    step_id: int,
    timing: Any,
    tree_nodes: int,
    *,
    model_name: str = "",
    accepted: int | None = None,
    tokens: int | None = None,
) -> None:
    """One served step: `step` is build_tree (draft) or verify (target)."""
    STEP_QUEUE_SECONDS.labels(step).observe(timing.queue_seconds)
    TREE_NODES.labels(step).observe(tree_nodes)
    fields: dict[str, Any] = {}
    if step == "verify":
        TARGET_FORWARD_SECONDS.observe(timing.compute_seconds)
        if tree_nodes > 1 and accepted is not None:
            SPEC_DRAFTS.labels(model_name).inc()
            SPEC_DRAFT_TOKENS.labels(model_name).inc(tree_nodes - 1)
            SPEC_ACCEPTED.labels(model_name).inc(accepted)
            for position in range(accepted):
                SPEC_ACCEPTED_PER_POS.labels(model_name, str(position)).inc()
            SPEC_ACCEPTANCE_LENGTH.labels(model_name).observe(accepted + 1)
        fields = {"accepted": accepted, "tokens": tokens}
    else:
        DRAFT_BUILD_SECONDS.observe(timing.compute_seconds)
    event(
        log,
        "step",
        session=session,
        step=step,
        step_id=step_id,
        tree_nodes=tree_nodes,
        queue_s=timing.queue_seconds,
        compute_s=timing.compute_seconds,
        **fields,
    )


def observe_verify_pass(pass_sessions: int, pass_tokens: int, seconds: float) -> None:
    """One target pass: how many sessions shared it, and how long it took. Each step's wait for it is
    step_queue_seconds."""
    VERIFY_PASS_SESSIONS.observe(pass_sessions)
    VERIFY_PASS_TOKENS.observe(pass_tokens)
    VERIFY_PASS_SECONDS.observe(seconds)


def observe_prefill_chunk(tokens: int) -> None:
    PREFILL_CHUNKS.inc()
    PREFILL_CHUNK_TOKENS.inc(tokens)


def observe_shared_prefix(role: str, prompt_tokens: int, shared_tokens: int) -> None:
    SESSION_PROMPT_TOKENS.labels(role).inc(prompt_tokens)
    SESSION_SHARED_TOKENS.labels(role).inc(shared_tokens)


def observe_preemptions(count: int) -> None:
    PREEMPTIONS.inc(count)


def observe_draft_pass(pass_sessions: int, pass_tokens: int, seconds: float) -> None:
    """One draft pass: how many sessions' forwards shared it, its tokens and its time."""
    DRAFT_PASS_SESSIONS.observe(pass_sessions)
    DRAFT_PASS_TOKENS.observe(pass_tokens)
    DRAFT_PASS_SECONDS.observe(seconds)


class RpcMetrics(grpc.ServerInterceptor):
    """Counts every RPC by method and status code and times it; logs the ones that fail."""

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit(".", 1)[-1]  # "TargetService/Verify"
        kind = (
            "unary_unary"
            if handler.unary_unary
            else "unary_stream"
            if handler.unary_stream
            else "stream_unary"
            if handler.stream_unary
            else "stream_stream"
        )
        behavior = getattr(handler, kind)
        streams_out = kind.endswith("stream")

        def finish(request: Any, context: grpc.ServicerContext, start: float, failed: bool) -> None:
            """A call the client ended (a stream it stopped reading: its generator closed) counts as
            CANCELLED, logged at INFO: clients stop runs at stop strings and limits as a matter of course."""
            code = context.code()
            if code is None:
                code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
            if code in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN) and not context.is_active():
                code = grpc.StatusCode.CANCELLED
            seconds = time.perf_counter() - start
            RPC_REQUESTS.labels(method, code.name).inc()
            RPC_SECONDS.labels(method).observe(seconds)
            if code != grpc.StatusCode.OK:
                session = getattr(request, "session_id", None) or None
                cancelled = code == grpc.StatusCode.CANCELLED
                message = "" if cancelled else (context.details() or "")[:300]
                if isinstance(message, bytes):
                    message = message.decode(errors="replace")
                event(log, "rpc_cancelled" if cancelled else "rpc_failed", logging.INFO if cancelled else logging.WARNING,
                      method=method, code=code.name, session=session, seconds=seconds, message=message)  # fmt: skip

        if streams_out:

            def wrapped_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start, failed = time.perf_counter(), True
                try:
                    yield from behavior(request, context)
                    failed = False
                finally:
                    finish(request, context, start, failed)

            wrapped: Any = wrapped_stream
        else:

            def wrapped_unary(request: Any, context: grpc.ServicerContext) -> Any:
                start, failed = time.perf_counter(), True
                try:
                    response = behavior(request, context)
                    failed = False
                    return response
                finally:
                    finish(request, context, start, failed)

            wrapped = wrapped_unary
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# ------------------------------------------------------------------------------------------------
# Gateway


def track_generation(
    chunks: Iterator[Any],
    *,
    request_id: str,
    endpoint: str,
    prompt_tokens: int | None = None,
    prompt: Any = None,
) -> Iterator[Any]:
    """Pass a generation's chunks through, counting it; log one line when it ends (text only with
    --log-prompts). Closing this closes `chunks`, which closes the nodes' sessions."""
    start = time.perf_counter()
    first: float | None = None
    generated, finish, stats, texts = 0, None, None, []
    REQUESTS_RUNNING.inc()
    if prompt_tokens:
        PROMPT_TOKENS.inc(prompt_tokens)
        PREFIX_CACHE_QUERIES.inc(prompt_tokens)
    outcome = "cancelled"
    try:
        for chunk in chunks:
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
                TTFT_SECONDS.observe(first)
            generated += len(chunk.token_ids)
            GENERATION_TOKENS.inc(len(chunk.token_ids))
            if logs.LOG_PROMPTS:
                texts.append(chunk.text)
            if chunk.finish_reason is not None:
                finish, stats = chunk.finish_reason, chunk.stats
            yield chunk
        outcome = "finished"
    except Exception:
        outcome = "error"
        raise
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        REQUESTS_RUNNING.dec()
        seconds = time.perf_counter() - start
        if finish is not None:
            REQUEST_SUCCESS.labels(finish).inc()
            E2E_SECONDS.observe(seconds)
            if stats is not None:
                PREFIX_CACHE_HITS.inc(stats.cached_prompt_tokens)
        fields: dict[str, Any] = {
            "request": request_id,
            "endpoint": endpoint,
            "outcome": outcome,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "seconds": seconds,
            "ttft_s": first,
        }
        if stats is not None:
            fields.update(
                target_steps=stats.target_steps,
                tokens_per_step=stats.tokens_per_step,
                draft_s=stats.draft_seconds,
                target_s=stats.target_seconds,
                draft_failures=stats.draft_failures,
            )
        if logs.LOG_PROMPTS:  # text only: a prompt given as token ids stays out of the logs
            shown = None if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else prompt
            fields.update(prompt=shown, completion="".join(texts))
        event(gateway_log, "request_finished", **fields)
