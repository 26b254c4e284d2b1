"""gRPC adapters with the same interface as the in-process engines, so `Sequence` drives either."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import SpecExec
from client.generation import Recovery, close_quietly
from common.decoding.grammar import Grammar
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams
from common.decoding.types import NodeInfo, VerifyResult, describe_model, model_identity
from common.model.loading import tokenizer_fingerprint
from common.model.store import cache_root
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.security import ClientSecurity
from common.rpc.server import CHANNEL_OPTIONS
from common.rpc.servicer import CLIENT_KEY
from common.rpc.wire import (
    grammar_to_proto,
    logprobs_from_proto,
    node_info_from_proto,
    sampling_to_proto,
    tree_from_proto,
    tree_params_to_proto,
    tree_to_proto,
)
from common.runtime.faults import NodeChanged, NodeRefused, NodeUnavailable, SessionLost
from common.runtime.sessions import TooManySessions

DEFAULT_STEP_TIMEOUT = 120.0
DEFAULT_CALL_TIMEOUT = 30.0
DEFAULT_PROBE_TIMEOUT = 3.0  # the draft's Info: a draft that does not answer by then counts as down
# A channel backs off between attempts to reach a node that is down, by default up to 120 s; a node
# that comes back is then only seen that long after. Capped, a draft that returns is used soon.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]


class NodeError(NodeRefused, RuntimeError):
    """A node refused a request; `code` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NodeAuthError(NodeError, ConnectionError):
    """The node refused this client's credentials (UNAUTHENTICATED or PERMISSION_DENIED): retrying
    cannot help, so it is not a `NodeFault`; the CLI reports it like any connection error."""


class NodeRoleError(NodeError, ConnectionError):
    """The address answers gRPC but not this role's service (UNIMPLEMENTED): the other node, or the
    gateway, given to the wrong flag. Like a refusal, retrying cannot help."""


_OTHER_ROLE = {"target": "draft", "draft": "target"}
_TLS_FAILURE_SIGNS = ("Socket closed", "andshake", "SSL", "certificate")


def tls_hint(code: grpc.StatusCode, details: str | None, security: ClientSecurity | None) -> str:
    """What to check when a connection fails as a TLS mismatch does; nothing for a call cut short
    on a connection that worked ("Stream removed": the node went away)."""
    details = details or ""
    if code != grpc.StatusCode.UNAVAILABLE or "Stream removed" in details:
        return ""
    if not any(sign in details for sign in _TLS_FAILURE_SIGNS):
        return ""
    return f" ({(security or ClientSecurity()).hint()})"


def _call(
    role: str,
    address: str,
    fn: Any,
    request: Any,
    timeout: float,
    metadata: Any,
    security: ClientSecurity | None = None,
) -> Any:
    try:
        return fn(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise _fault(role, address, exc, security) from exc


def _fault(role: str, address: str, exc: grpc.RpcError, security: ClientSecurity | None) -> Exception:
    """What a failed call means to the caller: a fault to ride out, a refusal, or a bad request."""
    code, details = exc.code(), exc.details()
    # This client cancels only calls it no longer reads: CANCELLED means the node cut the call short,
    # as a server does to in-flight calls when it shuts down.
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ):
        return NodeUnavailable(
            f"{role} node at {address} is unavailable ({code.name}): {details}{tls_hint(code, details, security)}",
            timed_out=code == grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return NodeAuthError(code, f"{role} node at {address} refused this client ({code.name}): {details}")
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return SessionLost(f"{role} node at {address}: {code.name}: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"{role} node refused the request: {details}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return NodeRoleError(code, f"{address} does not serve the {role} node's service ({details}); "
                             f"is it the {_OTHER_ROLE.get(role, 'other')} node or a gateway? "
                             f"--target takes the target node's address, --draft the draft's")  # fmt: skip
    return NodeError(code, f"{role} node at {address}: {code.name}: {details}")


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    options = CHANNEL_OPTIONS + RECONNECT_OPTIONS
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


class _RemoteNode:
    role = ""

    def __init__(
        self,
        address: str,
        *,
        channel: grpc.Channel | None = None,
        client_key: str | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address
        self.security = security or ClientSecurity()
        self.channel = channel or open_channel(address, self.security.channel_credentials())
        self.metadata = ((CLIENT_KEY, client_key or secrets.token_hex(16)), *self.security.metadata())
        self.step_timeout, self.call_timeout = step_timeout, call_timeout
        self._steps: dict[str, int] = {}
        self._info: NodeInfo | None = None
        self._expected: tuple[str, str, str] | None = None  # (`expect`)

    def _rpc(self, fn: Any, request: Any, timeout: float | None = None) -> Any:
        timeout = timeout or self.call_timeout
        return _call(self.role, self.address, fn, request, timeout, self.metadata, self.security)

    def _step(self, fn: Any, request: Any) -> Any:
        """A call that is one of the session's steps. A node counts a step only once it has served it,
        so a refused one (a context or tree limit) is not counted here either: the session's next
        call must not arrive out of order."""
        try:
            return self._rpc(fn, request, self.step_timeout)
        except (ValueError, NodeError):
            self._not_taken(request)
            raise

    def _not_taken(self, request: Any) -> None:
        """The node did not take this step: the session's next call reuses its id."""
        self._steps[request.session_id] = request.step_id - 1

    def _next_step(self, session_id: str) -> int:
        self._steps[session_id] = self._steps.get(session_id, 0) + 1
        return self._steps[session_id]

    def info(self) -> NodeInfo:
        if self._info is None:
            self._info = self._fresh_info()
            self.expect(self._info)
        return self._info

    def _fresh_info(self, timeout: float | None = None) -> NodeInfo:
        return node_info_from_proto(self._rpc(self.stub.Info, pb.InfoRequest(), timeout))

    def expect(self, info: NodeInfo) -> None:
        """The model this client checked: each session opened from now on must be served by it."""
        self._expected = model_identity(info)

    def _check_model(self, identity: tuple[str, str, str]) -> None:
        """Raise `NodeChanged` if the node now serves another model than the one this client checked."""
        expected = self._expected
        if expected is None or identity == expected:
            return
        advice = ("restart the node with that model, or this client to use the new one" if self.role == "target"
                  else "it is used again once checked against the target")  # fmt: skip
        raise NodeChanged(
            f"{self.role} node at {self.address} now serves {describe_model(identity)}, not "
            f"{describe_model(expected)} as when this client checked it; {advice}"
        )

    def serving(self, timeout: float = DEFAULT_PROBE_TIMEOUT) -> str | None:
        """None when the node answers its standard health check as SERVING, else why not: what a
        gateway's /health reports, since a generation would fail on a node that does not."""
        try:
            answer = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    def open_session(self, prompt: list[int]) -> str:
        """Refused for the node's session limit, it raises what an engine in this process would:
        `TooManySessions` (the decode loop runs on without a full draft; a gateway relays it as
        RESOURCE_EXHAUSTED)."""
        try:
            opened = self._rpc(self.stub.OpenSession, pb.OpenSessionRequest(prompt=prompt))
        except NodeError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise TooManySessions(str(exc)) from exc
            raise
        except ValueError:  # a prompt checked against the model it had may be one another cannot read
            self._check_model(model_identity(self._fresh_info()))
            raise
        if opened.model_id:  # a node from before the field says nothing
            try:
                self._check_model((opened.model_id, opened.tokenizer_fingerprint, opened.dtype))
            except NodeChanged:
                close_quietly(self, opened.session_id)
                raise
        self._steps[opened.session_id] = 0
        return opened.session_id

    def close_session(self, session_id: str) -> bool:
        self._steps.pop(session_id, None)
        return self._rpc(self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id)).closed

    def close(self) -> None:
        self.channel.close()


class RemoteDraft(_RemoteNode):
    role = "draft"
    runs_apart = True  # on a machine of its own: its catch-up overlaps the target's steps (Sequence)

    def __init__(self, address: str, *, probe_timeout: float = DEFAULT_PROBE_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.stub = pb_grpc.DraftServiceStub(self.channel)
        self.probe_timeout = probe_timeout

    def info(self) -> NodeInfo:
        """Asked afresh each time, under a short deadline: `DraftLink` probes a draft that may be down
        with it, and a draft that came back may serve another model. The link keeps what it checked,
        and tells this adapter (`expect`): sessions are checked against that, not the last answer."""
        return self._fresh_info(self.probe_timeout)

    def build_tree(
        self,
        session_id: str,
        new_tokens: list[int],
        params: TreeParams,
        truncate_to: int | None = None,
        grammar: Grammar | None = None,
    ) -> DraftedTree:
        request = pb.BuildTreeRequest(
            session_id=session_id,
            step_id=self._next_step(session_id),
            new_tokens=new_tokens,
            truncate_to=truncate_to,
            params=tree_params_to_proto(params),
            grammar=grammar_to_proto(grammar),
        )
        response = self._step(self.stub.BuildTree, request)
        node_seconds = response.build_seconds + response.queue_seconds
        return DraftedTree(
            tree_from_proto(response.tree), response.draft_forwards, node_seconds, reused=response.reused
        )


class RemoteTarget(_RemoteNode):
    role = "target"
    runs_apart = True  # each call is a round trip: steps on the target alone go as runs (Sequence)

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.stub = pb_grpc.TargetServiceStub(self.channel)

    def serving(self, timeout: float = DEFAULT_PROBE_TIMEOUT) -> str | None:
        """Serving, and as the model this client checked: a target restarted as another would fail
        every request (a gateway's /health then says so), and is never used in its place."""
        why = super().serving(timeout)
        if why is not None or self._expected is None:
            return why
        try:
            self._check_model(model_identity(self._fresh_info(timeout)))
        except (NodeChanged, NodeUnavailable, NodeError) as exc:
            return str(exc)
        return None

    def verify(
        self,
        session_id: str,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        append: list[int] | None = None,
        truncate_to: int | None = None,
    ) -> VerifyResult:
        request = pb.VerifyRequest(
            session_id=session_id,
            step_id=self._next_step(session_id),
            tree=tree_to_proto(tree),
            sampling=sampling_to_proto(replace(params, stop=())),  # stop strings are the client's job
            max_tokens=max_tokens,
            append=append or [],
            truncate_to=truncate_to,
        )
        return _verify_result(self._step(self.stub.Verify, request))

    def decode(
        self,
        session_id: str,
        last_token: int,
        params: SamplingParams,
        max_tokens: int,
        steps: int,
        append: list[int] | None = None,
        truncate_to: int | None = None,
    ) -> Iterator[VerifyResult]:
        """Each token of a run of `steps` on the target alone as it is committed; the call is
        cancelled when the caller stops reading. Its deadline is one step's: `Sequence` sizes runs
        to fit it. A node from before Decode is sent the run's first step as a Verify, and the run
        ends there."""
        request = pb.DecodeRequest(
            session_id=session_id,
            step_id=self._next_step(session_id),
            last_token=last_token,
            sampling=sampling_to_proto(replace(params, stop=())),
            max_tokens=max_tokens,
            append=append or [],
            truncate_to=truncate_to,
            steps=steps,
        )
        call = self.stub.Decode(request, timeout=self.step_timeout, metadata=self.metadata)
        served = False
        try:
            for response in call:
                served = True
                yield _verify_result(response)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                fault = _fault(self.role, self.address, exc, self.security)
                if not served and isinstance(fault, (ValueError, NodeError)):  # refused (`_step`)
                    self._not_taken(request)
                raise fault from exc
            # A node older than Decode saw no step: this run is its first step alone, as a Verify,
            # and every step from now on goes a call each.
            self.runs_apart = False
            self._not_taken(request)
            yield self.verify(session_id, TokenTree.root_only(last_token), params, max_tokens, append, truncate_to)
        finally:
            call.cancel()

    def tokenizer(self) -> Any:
        """The target's tokenizer, fetched once and cached on disk by fingerprint."""
        from transformers import AutoTokenizer

        fingerprint = self.info().tokenizer_fingerprint
        folder = cache_root() / "tokenizers" / fingerprint
        if not (folder / "complete").is_file():
            files = self._rpc(self.stub.GetTokenizer, pb.InfoRequest())
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=folder.parent))
            for name, data in files.files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"target sent a tokenizer file with an unsafe name: {name!r}")
                (staging / name).write_bytes(data)
            (staging / "complete").write_text(fingerprint)
            try:
                staging.rename(folder)
            except OSError:
                if not (folder / "complete").is_file():
                    raise
                shutil.rmtree(staging)  # another process cached the same files first
        tokenizer = AutoTokenizer.from_pretrained(folder)
        got = tokenizer_fingerprint(tokenizer)
        if got != fingerprint:
            raise ValueError(
                f"tokenizer files from {self.address} hash to {got}, but the node reports {fingerprint}"
            )
        return tokenizer


def _verify_result(r: pb.VerifyResponse) -> VerifyResult:
    if r.logprobs and len(r.logprobs) != len(r.tokens):
        raise ValueError(f"the target node sent {len(r.logprobs)} log-probabilities for {len(r.tokens)} tokens")
    return VerifyResult(
        list(r.tokens),
        r.accepted,
        r.finish_reason or None,
        r.forward_seconds + r.queue_seconds,
        pass_sessions=max(r.pass_sessions, 1),
        pass_tokens=r.pass_tokens,
        shared_tokens=r.cached_tokens,
        logprobs=logprobs_from_proto(r.logprobs),
    )


def connect(
    draft: str | None,
    target: str,
    *,
    mode: str = "specexec",
    tree: TreeParams | None = None,
    auto_budget: bool = False,
    recovery: Recovery | None = None,
    planner_dir: Path | None = None,
    **kwargs: Any,
) -> SpecExec:
    """A `SpecExec` whose nodes are remote. The target must be up; the draft is optional: one that is
    down is reported (through `recovery.notify`) and used once it comes up, while one that is up
    must share the target's tokenizer, or this raises `TokenizerMismatch`.

    `security=ClientSecurity.from_files(ca=..., cert=..., key=..., token_file=...)` (common.rpc.security)
    connects over TLS and/or sends the nodes' shared token; other kwargs go to `RemoteTarget`/`RemoteDraft`.
    """
    remote_target = RemoteTarget(target, **kwargs)
    remote_draft = RemoteDraft(draft, **kwargs) if draft else None
    return SpecExec(
        remote_target,
        remote_draft,
        remote_target.tokenizer(),
        mode=mode,
        tree=tree,
        auto_budget=auto_budget,
        recovery=recovery,
        planner_dir=planner_dir,
    )


def wait_until_serving(
    address: str, timeout: float, alive: Any = None, security: ClientSecurity | None = None
) -> None:
    """Poll standard gRPC health until the node has loaded its model (SERVING). Health needs no
    token, but a TLS node needs the channel credentials (and a client certificate under mutual TLS)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    last = "no answer"
    with open_channel(address, security.channel_credentials() if security else None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise NodeUnavailable(f"the node at {address} exited before it was ready")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = "NOT_SERVING: it answers, and is still loading its model or measuring its forward-time curve"
            except grpc.RpcError as exc:  # not listening yet, or a TLS mismatch: said if it never serves
                last = f"{exc.code().name}: {exc.details()}{tls_hint(exc.code(), exc.details(), security)}"
            time.sleep(0.2)
    raise NodeUnavailable(f"the node at {address} was not serving after {timeout:.0f} s (last: {last})")
