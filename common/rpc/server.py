"""What every gRPC server here shares: status mapping, limits, health, reflection, graceful stop."""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.decoding.tree import TreeTooLarge
from common.ops.metrics import RpcMetrics
from common.runtime.sessions import SessionNotFound, StepCancelled, StepOutOfOrder, TooManySessions

log = logging.getLogger("specexec.rpc")

# Only a node's answer to GetTokenizer is large (a tokenizer file can exceed gRPC's 4 MiB default).
# Requests stay under 4 MiB: a tree of the maximum wire size (65,536 nodes) takes 768 KiB, a prompt
# of 131,072 token ids at most 640 KiB. A server reading 64 MiB requests would let any client make
# it buffer that much per call.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_REQUEST_BYTES = 4 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second node on a busy port must fail, not share it
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
]
SERVER_VERSION = "0.1.0"

F = TypeVar("F", bound=Callable[..., Any])


class NotReady(RuntimeError):
    """The node is still loading its model."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """Domain errors to status codes; a peer's own status (relayed by the gateway) passes through."""
    relayed = getattr(exc, "code", None)
    if isinstance(relayed, grpc.StatusCode):
        return relayed
    if isinstance(exc, ConnectionError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, StepOutOfOrder):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, StepCancelled):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, TooManySessions | TreeTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ValueError | OverflowError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def rpc_method(fn: F) -> F:
    """Turn domain errors into status codes; a bad request never escapes as a crash."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:
            abort_for(context, exc, fn.__name__)

    return wrapper  # type: ignore[return-value]


def abort_for(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    """End the call with the status `exc` maps to; what maps to INTERNAL is a bug, so it is logged."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
    context.abort(code, str(exc) or type(exc).__name__)


class StoppedStarting(BaseException):
    """A signal came while the node was still loading or profiling: its start is abandoned. Not an
    `Exception`, as KeyboardInterrupt is not: no `except Exception` on the way may swallow it."""


class Server:
    """A gRPC server that answers health checks (NOT_SERVING until `ready()`) and reflection."""

    def __init__(
        self,
        listen: str,
        services: Iterable[tuple[Callable[[Any, grpc.Server], None], Any, str]],
        *,
        max_workers: int = 16,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: list[grpc.ServerInterceptor] | None = None,
    ) -> None:
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            options=SERVER_OPTIONS,
            interceptors=[RpcMetrics(), *(interceptors or [])],  # metrics first: refusals count too
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = []
        for add, servicer, name in services:
            add(servicer, self.server)
            self.service_names.append(name)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, credentials)
        except RuntimeError as e:
            raise OSError(f"--listen {listen}: could not bind (is another process on that port?)") from e
        if self.port == 0:
            raise OSError(f"--listen {listen}: could not bind (is another process on that port?)")
        self.stopped = threading.Event()
        self.serving = False
        self._health_lock = threading.Lock()
        self._stopping = False

    def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self) -> Server:
        self.server.start()
        return self

    def ready(self) -> None:
        self.serving = True
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def follow(self, up: bool) -> None:
        """Between `ready()` and `stop()`, health follows what the service needs (a gateway's target
        node), so balancers stop sending while requests could only fail."""
        with self._health_lock:
            if self.serving and not self._stopping:
                status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
                self._set_all(status)

    def stop(self, grace: float = 5.0) -> None:
        """Health goes NOT_SERVING first so balancers and clients stop sending, then in-flight calls
        get `grace` seconds to finish before they are cancelled."""
        with self._health_lock:
            self._stopping = True
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace).wait()
        self.stopped.set()

    def stop_on_signals(self, grace: float = 5.0) -> None:
        """Serving, the node stops gracefully. Still starting (a model's load, a cold start's minutes of
        profiling), it stops at once: the handler raises `StoppedStarting` in the main thread, where
        the start runs, between two of its passes."""
        stopping = threading.Event()

        def handler(signum: int, _frame: Any) -> None:
            if stopping.is_set():
                return
            stopping.set()
            log.info("signal %d: shutting down", signum)
            threading.Thread(target=self.stop, args=(grace,), daemon=True).start()
            if not self.serving:
                raise StoppedStarting(f"signal {signum} before the node was ready")

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def wait(self) -> None:
        self.stopped.wait()


def loopback_only(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", "[::1]") or host.startswith("127.")


def split_listen(listen: str, flag: str = "listen address") -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {listen!r}")
    if int(port) > 65535:
        raise ValueError(f"{flag} port must be in [0, 65535], got {listen!r}")  # gRPC would take it modulo 65536
    return host, int(port)


def start_reaper(tables: Iterable[Any], every: float = 10.0) -> threading.Event:
    """Expire idle sessions even when no request arrives, so their KV caches are freed."""
    stop = threading.Event()
    tables = list(tables)

    def loop() -> None:
        while not stop.wait(every):
            for table in tables:
                expired = table.expire()
                if expired:
                    log.info("expired %d idle session(s)", expired)

    threading.Thread(target=loop, daemon=True, name="session-reaper").start()
    return stop


def check_listen(listen: str, insecure: bool, secured: bool = False, flag: str = "--listen") -> None:
    """Loopback is always allowed; another address needs TLS and a token (`secured`), or --insecure."""
    host, _ = split_listen(listen, flag)
    if not loopback_only(host) and not secured and not insecure:
        raise ValueError(
            f"{flag}: refusing to listen on {host}: a non-loopback address needs both TLS (--tls-cert and --tls-key) "
            "and a shared token (--auth-token-file); pass --insecure to expose the server without them"
        )
