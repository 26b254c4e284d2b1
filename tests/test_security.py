"""TLS, mutual TLS, the shared token and the bind policy, on real node and gateway processes.

One `specexec certs` directory serves every process here: a target that requires TLS, a client
certificate and the token; a draft that requires TLS and the token; a gateway in front of them that
requires TLS and the token. All three listen on 0.0.0.0, which TLS plus a token allows.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.cli.main import main as cli_main
from client.remote import NodeAuthError, RemoteDraft, RemoteTarget, connect, open_channel
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.security import ClientSecurity, read_token
from common.rpc.server import check_listen
from common.runtime.faults import NodeUnavailable
from tests.helpers import Proc, free_port, reference_decode

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HOSTS = "node.example,10.9.8.7"
SERVER = "server-node.example"
PROMPT = "Hello, "
BUDGET = 16
GREEDY = dict(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict[str, str]]:
    home = str(tmp_path_factory.mktemp("specexec_home"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEXEC_HOME", home)
        yield {**os.environ, "PYTHONPATH": str(ROOT), "SPECEXEC_HOME": home}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """What `specexec certs` writes; every process and client below uses it."""
    out = tmp_path_factory.mktemp("certs")
    assert cli_main(["certs", "--out", str(out), "--hosts", HOSTS, "--force"]) == 0
    return out


def creds(certs: Path, *, ca=True, cert=True, token: str | None = "token") -> ClientSecurity:
    """A client's security: any part can be left out, or the token taken from another file."""
    return ClientSecurity.from_files(
        certs / "ca.pem" if ca else None,
        certs / "client.pem" if cert else None,
        certs / "client-key.pem" if cert else None,
        certs / token if token else None,
    )


def client_flags(certs: Path, token: str = "token") -> list[str]:
    return [
        "--node-tls-ca",
        str(certs / "ca.pem"),
        "--node-tls-cert",
        str(certs / "client.pem"),
        "--node-tls-key",
        str(certs / "client-key.pem"),
        "--node-auth-token-file",
        str(certs / token),
    ]


@pytest.fixture(scope="module")
def stack(model_dirs, certs, env, tmp_path_factory) -> Iterator[dict]:
    """Target (mTLS + token), draft (TLS + token) and gateway (TLS + token), all on 0.0.0.0; and two
    bind-policy probes: TLS without a token (refused) and the same with --insecure (starts)."""
    logs = tmp_path_factory.mktemp("security_logs")
    tls = ["--tls-cert", str(certs / f"{SERVER}.pem"), "--tls-key", str(certs / f"{SERVER}-key.pem")]
    token = ["--auth-token-file", str(certs / "token")]
    mtls = ["--tls-client-ca", str(certs / "ca.pem")]
    node = ["--max-tree", str(BUDGET), "--max-context", "1024", "--no-profile"]
    ports = {name: free_port() for name in ("target", "draft", "gateway", "refused", "insecure")}
    specs = {
        "target": [*("-m", "target_node", "--model", str(model_dirs["target"])), *node, *tls, *token, *mtls],
        "draft": ["-m", "draft_node", "--model", str(model_dirs["truncated"]), *node, *tls, *token],
        "refused": ["-m", "target_node", "--model", str(model_dirs["target"]), *node, *tls],
        "insecure": ["-m", "draft_node", "--model", str(model_dirs["truncated"]), *node, *tls, "--insecure"],
    }
    procs = {
        name: Proc(name, [*args, "--listen", f"0.0.0.0:{ports[name]}"], env, logs)
        for name, args in specs.items()
    }
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    try:
        procs["target"].wait_serving(addr["target"], creds(certs, token=None))
        procs["draft"].wait_serving(addr["draft"], creds(certs, cert=False, token=None))
        procs["gateway"] = Proc(
            "gateway",
            [
                "-m",
                "client.cli.main",
                "serve",
                "--target",
                addr["target"],
                "--draft",
                addr["draft"],
                "--listen",
                f"0.0.0.0:{ports['gateway']}",
                "--budget",
                str(BUDGET),
                *tls,
                *token,
                *client_flags(certs),
            ],
            env,
            logs,
        )
        procs["gateway"].wait_serving(addr["gateway"], creds(certs, cert=False, token=None))
        yield {"addr": addr, "procs": procs}
    finally:
        for proc in procs.values():
            if proc.alive():
                proc.popen.terminate()  # all at once: each takes its grace period to stop
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def reference(model_dirs) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dirs["target"]).encode(PROMPT)
    return reference_decode(model_dirs["target"], ids, SamplingParams(**GREEDY))


def generate_over_wire(stack, security: ClientSecurity) -> list[int]:
    addr = stack["addr"]
    gen = connect(addr["draft"], addr["target"], tree=TreeParams(budget=BUDGET), security=security)
    try:
        return gen.generate(PROMPT, SamplingParams(**GREEDY)).token_ids
    finally:
        gen.target.close()
        gen.draft.close()


# ------------------------------------------------------------------------------------------------
# specexec certs


def test_certs_writes_a_ca_server_and_client_certificates_and_a_private_token(certs):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    for name in ("ca-key.pem", f"{SERVER}-key.pem", "server-10.9.8.7-key.pem", "client-key.pem", "token"):
        assert stat.S_IMODE((certs / name).stat().st_mode) == 0o600, name
    assert len(read_token(certs / "token")) >= 32
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    for stem, name in ((SERVER, "node.example"), ("server-10.9.8.7", "10.9.8.7")):
        cert = x509.load_pem_x509_certificate((certs / f"{stem}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = {str(n) for n in san.get_values_for_type(x509.DNSName)}
        names |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        assert {name, "localhost", "127.0.0.1", "::1"} <= names
    client = x509.load_pem_x509_certificate((certs / "client.pem").read_bytes())
    client.verify_directly_issued_by(ca)
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage


def test_a_key_that_is_not_the_certificates_is_named_not_taken_for_a_busy_port(certs, capsys):
    """The node printed gRPC's "Invalid private key" lines, then "could not bind (is another process
    on that port?)"; a client, a dozen lines and "Failed to create security handshaker"."""
    from common.rpc.security import ServerSecurity

    with pytest.raises(ValueError, match=r"--tls-key .*client-key\.pem is not the private key of --tls-cert"):
        ServerSecurity.from_files(certs / f"{SERVER}.pem", certs / "client-key.pem")
    with pytest.raises(ValueError, match=r"--node-tls-key .* is not the private key of --node-tls-cert"):
        ClientSecurity.from_files(certs / "ca.pem", certs / "client.pem", certs / f"{SERVER}-key.pem")
    with pytest.raises(ValueError, match=r"--node-tls-key .*client\.pem is not the private key"):
        ClientSecurity.from_files(certs / "ca.pem", certs / "client.pem", certs / "client.pem")
    assert ServerSecurity.from_files(certs / f"{SERVER}.pem", certs / f"{SERVER}-key.pem").tls
    assert cli_main(["draft", "--model", "m", "--listen", "127.0.0.1:1", "--tls-cert", str(certs / f"{SERVER}.pem"),
                     "--tls-key", str(certs / "client-key.pem")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "is not the private key of --tls-cert" in err and "bind" not in err


def test_certs_refuses_to_overwrite_without_force(certs, capsys):
    assert cli_main(["certs", "--out", str(certs), "--hosts", HOSTS]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["certs", "--out", str(certs / "ca.pem"), "--hosts", HOSTS, "--force"]) == 2  # was "[Errno 17]"
    assert f"--out {certs / 'ca.pem'} is a file, not a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# TLS and mutual TLS


def test_tls_client_generates_exactly_the_target_alone(stack, certs, reference):
    assert generate_over_wire(stack, creds(certs)) == reference


def test_cli_generate_with_certs_output_and_with_a_wrong_token(stack, certs, env, reference):
    """The `specexec certs` files end to end through `specexec generate`; a wrong token is a clean error."""
    (certs / "wrong-token").write_text("not-the-token\n")
    (certs / "wrong-token").chmod(0o600)
    addr = stack["addr"]
    common = ["-m", "client.cli.main", "generate", "--target", addr["target"], "--draft", addr["draft"]]
    common += [
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--budget",
        str(BUDGET),
        "--json",
    ]
    runs = {
        token: subprocess.Popen(
            [sys.executable, *common, *client_flags(certs, token)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for token in ("token", "wrong-token")
    }
    out = {token: proc.communicate(timeout=120) for token, proc in runs.items()}
    assert runs["token"].returncode == 0, out["token"][1]
    assert json.loads(out["token"][0])["token_ids"] == reference
    stderr = out["wrong-token"][1]
    assert runs["wrong-token"].returncode == 2, stderr
    assert "Traceback" not in stderr
    assert "specexec: error:" in stderr and "UNAUTHENTICATED" in stderr and "not valid" in stderr


def test_plaintext_client_against_a_tls_node_is_a_clear_node_unavailable(stack, certs):
    node = RemoteTarget(stack["addr"]["target"], security=creds(certs, ca=False, cert=False), call_timeout=10)
    with pytest.raises(NodeUnavailable, match="--node-tls-ca") as err:
        node.info()
    assert "target node at" in str(err.value) and not err.value.timed_out
    node.close()
    # gRPC's C core logged each failed handshake to stderr at INFO, past --log-format json
    assert "Handshake failed" not in stack["procs"]["target"].log.read_text(errors="replace")


def test_status_gives_the_tls_hint_and_a_stream_cut_on_a_working_connection_none(stack, certs, capsys):
    """`status` said only "Socket closed" (generate gave the hint); a node killed mid-call was given
    the TLS hint although its connection had worked."""
    import grpc

    from client.cli.main import main
    from client.remote import tls_hint

    capsys.readouterr()
    assert main(["status", "--target", stack["addr"]["target"], "--timeout", "10", "--pings", "1"]) == 1
    assert "--node-tls-ca" in capsys.readouterr().out
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert "--node-tls-ca" in tls_hint(unavailable, "Socket closed", None)
    assert tls_hint(unavailable, "Stream removed (Socket closed)", None) == ""


def test_mutual_tls_refuses_a_client_without_a_certificate(stack, certs):
    """The target requires a client certificate; the draft, TLS only, accepts the same client."""
    security = creds(certs, cert=False)
    target = RemoteTarget(stack["addr"]["target"], security=security, call_timeout=10)
    with pytest.raises(NodeUnavailable, match="--node-tls-cert"):
        target.info()
    target.close()
    draft = RemoteDraft(stack["addr"]["draft"], security=security)
    assert draft.info().role == "draft"
    draft.close()


# ------------------------------------------------------------------------------------------------
# Token


@pytest.mark.parametrize("token, needle", [(None, "--node-auth-token-file"), ("wrong-token", "not valid")])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_missing_or_wrong_token_is_unauthenticated(stack, certs, role, token, needle):
    (certs / "wrong-token").write_text("not-the-token\n")
    (certs / "wrong-token").chmod(0o600)
    cls = RemoteTarget if role == "target" else RemoteDraft
    node = cls(stack["addr"][role], security=creds(certs, token=token))
    with pytest.raises(NodeAuthError, match=needle) as err:
        node.open_session([1, 2, 3])
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert f"{role} node at" in str(err.value)
    node.close()


def test_health_is_open_but_reflection_needs_the_token(stack, certs):
    security = creds(certs, token=None)
    with open_channel(stack["addr"]["target"], security.channel_credentials()) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        responses = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=creds(certs).metadata())
        services = {s.name for r in responses for s in r.list_services_response.service}
    assert "specexec.v1.TargetService" in services


def test_gateway_serves_tls_and_requires_the_token(stack, certs, reference):
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(**GREEDY))
    security = creds(certs, cert=False)
    with open_channel(stack["addr"]["gateway"], security.channel_credentials()) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        responses = list(stub.Generate(request, timeout=60, metadata=security.metadata()))
    assert [t for r in responses[:-1] for t in r.chunk.token_ids] == reference
    assert responses[-1].final.finish_reason == "length"


def test_token_file_readable_by_others_is_accepted_with_a_warning(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("  secret-token\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="specexec.security"):
        assert read_token(path) == "secret-token"
    assert "chmod 600" in caplog.text
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(path)


def test_a_missing_or_unreadable_file_is_named_with_its_flag(tmp_path):
    """They said only "[Errno 2] No such file or directory: 'nosuch'" or "[Errno 21] Is a directory"."""
    from common.rpc.security import read_pem

    with pytest.raises(FileNotFoundError, match="--node-auth-token-file nosuch does not exist"):
        read_token("nosuch", "--node-auth-token-file")
    with pytest.raises(IsADirectoryError, match=f"--node-tls-ca {tmp_path} is a directory, not a file"):
        read_pem(tmp_path, "--node-tls-ca")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    (tmp_path / "binary").chmod(0o600)
    with pytest.raises(ValueError, match=r"--auth-token-file .* is not text"):
        read_token(tmp_path / "binary")


# ------------------------------------------------------------------------------------------------
# Bind policy


def test_bind_policy():
    check_listen("127.0.0.1:1", insecure=False)
    check_listen("0.0.0.0:1", insecure=False, secured=True)
    check_listen("0.0.0.0:1", insecure=True)
    with pytest.raises(ValueError, match=r"TLS .*--auth-token-file.*--insecure"):
        check_listen("0.0.0.0:1", insecure=False)
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\], got '127.0.0.1:99999'"):
        check_listen("127.0.0.1:99999", insecure=False)  # gRPC would bind 34463


def test_public_bind_with_tls_and_token_starts_without_either_is_refused(stack, certs):
    procs = stack["procs"]
    assert all(procs[name].alive() for name in ("target", "draft", "gateway"))  # all on 0.0.0.0
    refused = procs["refused"]
    assert refused.finish() == 2
    out = refused.output()
    assert "refusing to listen on 0.0.0.0" in out and "--auth-token-file" in out and "--insecure" in out
    assert "Traceback" not in out
    procs["insecure"].wait_serving(stack["addr"]["insecure"], creds(certs, cert=False, token=None))
