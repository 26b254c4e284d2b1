"""The RPCs both node services share (Info, OpenSession, CloseSession), as a mixin over the
generated servicer base classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from common.ops.metrics import session_event, track_engine
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.rpc.server import SERVER_VERSION, NotReady, rpc_method
from common.rpc.wire import node_info_to_proto

CLIENT_KEY = "x-specexec-client"


def client_key(context: grpc.ServicerContext) -> str:
    """Sessions belong to the client key that opened them: a session id alone grants nothing."""
    return dict(context.invocation_metadata()).get(CLIENT_KEY, "")


class NodeServicer:
    role = ""

    def __init__(self) -> None:
        self.engine: Any = None
        self.model_dir: Path | None = None

    def attach(self, engine: Any, model_dir: Path | None = None) -> None:
        """Called once the model is loaded; until then every RPC answers UNAVAILABLE."""
        self.engine, self.model_dir = engine, model_dir
        track_engine(engine)
        engine.sessions.on_drop(self._dropped)

    def _dropped(self, session_id: str, why: str) -> None:
        """The session table dropped a session itself: it expired idle, or made room at the limit."""
        table = self.engine.sessions
        limit = {"idle_timeout_s": table.idle_timeout} if why == "expired" else {"evict_after_s": table.evict_after}
        session_event(why, session_id, **limit)

    def _engine(self) -> Any:
        if self.engine is None:
            raise NotReady(f"the {self.role} node is still loading its model")
        return self.engine

    @rpc_method
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        e = self._engine()
        return node_info_to_proto(e.info(), SERVER_VERSION, e.sessions.max_sessions, len(e.sessions))

    @rpc_method
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        engine = self._engine()
        sid = engine.open_session(list(request.prompt), client_key(context))
        session_event("opened", sid, prompt_tokens=len(request.prompt))
        info = engine.info()
        return pb.OpenSessionResponse(
            session_id=sid, model_id=info.model_id, tokenizer_fingerprint=info.tokenizer_fingerprint, dtype=info.dtype
        )

    @rpc_method
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        closed = self._engine().close_session(request.session_id, client_key(context))
        if closed:
            session_event("closed", request.session_id)
        return pb.CloseSessionResponse(closed=closed)
