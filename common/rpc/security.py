"""TLS and a shared bearer token for every gRPC port here, server side and client side.

Servers (`specexec target|draft|serve`):
    --tls-cert PATH --tls-key PATH   serve TLS with this certificate chain and private key
    --tls-client-ca PATH             also require client certificates signed by this CA (mutual TLS)
    --auth-token-file PATH           require `authorization: Bearer <token>` on every call except the
                                     standard health checks (reflection is protected too)

Clients, for the connections they open to nodes (`specexec generate|chat|profile|serve|local`):
    --node-tls-ca PATH               trust root of the nodes' certificates (turns TLS on)
    --node-tls-cert/--node-tls-key   a client certificate, for nodes that require one
    --node-auth-token-file PATH      the nodes' shared token

The `node-` prefix keeps a client flag distinct from a server flag on `serve`, which is both.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.ops.files import read_named

log = logging.getLogger("specexec.security")

AUTHORIZATION = "authorization"
# Orchestrators and load balancers probe health without credentials; it reveals nothing but liveness.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def read_pem(path: str | os.PathLike, flag: str) -> bytes:
    data = read_named(path, flag)
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path} is not a PEM file")
    return data


def check_key_pair(cert: str | os.PathLike, key: str | os.PathLike, cert_flag: str, key_flag: str) -> None:
    """A key that is not the certificate's was reported by gRPC as a port that could not be bound."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as exc:
        raise ValueError(f"{key_flag} {key} is not the private key of {cert_flag} {cert} "
                         f"({exc.reason or exc}); gRPC takes unencrypted PEM keys") from None  # fmt: skip
    except OSError as exc:
        raise ValueError(f"{cert_flag} {cert} or {key_flag} {key} cannot be read: {exc}") from None


def read_token(path: str | os.PathLike, flag: str = "--auth-token-file") -> str:
    """The token is the file's content without surrounding whitespace. A file other users can read
    is accepted with a warning (the token is then as good as public on that machine)."""
    raw = read_named(path, flag)
    mode = Path(path).stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s %s is accessible to other users (mode %03o): chmod 600 it", flag, path, stat.S_IMODE(mode)
        )
    try:
        token = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path} is not text: a token is one line of printable characters") from None
    if not token:
        raise ValueError(f"{flag} {path} is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{flag} {path} must hold one token without spaces or control characters")
    return token


# ------------------------------------------------------------------------------------------------
# Server side


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without running it."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **kwargs)
    return grpc.unary_unary_rpc_method_handler(abort, **kwargs)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Every call but a health check must carry `authorization: Bearer <token>` (compared in
    constant time); others are answered UNAUTHENTICATED before any servicer code runs."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(self._open):
            return handler
        values = [
            v for k, v in (handler_call_details.invocation_metadata or ()) if k.lower() == AUTHORIZATION
        ]
        if not values:
            return _abort_handler(
                handler,
                f"{method} needs 'authorization: Bearer <token>' metadata: this server requires the shared "
                "token (clients: --node-auth-token-file)",
            )
        given = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
        if len(values) > 1 or not hmac.compare_digest(given, self._expected):
            return _abort_handler(handler, f"{method}: the authorization token is not valid for this server")
        return handler


@dataclass(frozen=True)
class ServerSecurity:
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    client_ca: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca is not None and self.cert_chain is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return self.cert_chain is not None

    @property
    def complete(self) -> bool:
        """TLS and a token: what a non-loopback address requires (unless --insecure)."""
        return self.tls and self.token is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenAuthInterceptor(self.token)] if self.token is not None else []

    def describe(self) -> str:
        parts = ["TLS" if self.tls else "plaintext"]
        if self.client_ca is not None:
            parts.append("client certificates required")
        parts.append("token required" if self.token is not None else "no token")
        return ", ".join(parts)

    @staticmethod
    def from_files(
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        client_ca: str | os.PathLike | None = None,
        token_file: str | os.PathLike | None = None,
    ) -> ServerSecurity:
        security = ServerSecurity(
            cert_chain=read_pem(cert, "--tls-cert") if cert else None,
            private_key=read_pem(key, "--tls-key") if key else None,
            client_ca=read_pem(client_ca, "--tls-client-ca") if client_ca else None,
            token=read_token(token_file) if token_file else None,
        )
        if cert and key:
            check_key_pair(cert, key, "--tls-cert", "--tls-key")
        return security


# ------------------------------------------------------------------------------------------------
# Client side


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches nodes: TLS trust root, optional client certificate, optional token."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs both --node-tls-cert and --node-tls-key")
        if self.cert_chain is not None and self.root_ca is None:
            raise ValueError(
                "--node-tls-cert needs --node-tls-ca (the CA that signed the nodes' certificates)"
            )

    @property
    def tls(self) -> bool:
        return self.root_ca is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_ca, private_key=self.private_key, certificate_chain=self.cert_chain
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTHORIZATION, f"Bearer {self.token}"),) if self.token is not None else ()

    def hint(self) -> str:
        """Why a connection may fail at the TLS layer, in terms of this client's flags."""
        if not self.tls:
            return "if the node serves TLS, pass its CA with --node-tls-ca"
        return (
            "check that the node serves TLS with a certificate signed by --node-tls-ca that names this "
            "address, and whether it requires a client certificate (--node-tls-cert/--node-tls-key)"
        )

    @staticmethod
    def from_files(
        ca: str | os.PathLike | None = None,
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        token_file: str | os.PathLike | None = None,
    ) -> ClientSecurity:
        security = ClientSecurity(
            root_ca=read_pem(ca, "--node-tls-ca") if ca else None,
            cert_chain=read_pem(cert, "--node-tls-cert") if cert else None,
            private_key=read_pem(key, "--node-tls-key") if key else None,
            token=read_token(token_file, "--node-auth-token-file") if token_file else None,
        )
        if cert and key:
            check_key_pair(cert, key, "--node-tls-cert", "--node-tls-key")
        return security
