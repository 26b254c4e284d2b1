"""`specexec certs`: a private CA, a server certificate per host, a client certificate and a token.

Everything a two-machine deployment needs for `--tls-cert/--tls-key/--tls-client-ca` on the nodes
and `--node-tls-ca/--node-tls-cert/--node-tls-key` on clients, plus the shared `--auth-token-file`.
Keys are ECDSA P-256; private keys and the token are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ALWAYS_NAMES = ("localhost", "127.0.0.1", "::1")
CA_FILES = ("ca.pem", "ca-key.pem")
CLIENT_FILES = ("client.pem", "client-key.pem")
TOKEN_FILE = "token"


@dataclass(frozen=True)
class Issued:
    """What `generate` wrote: paths by role."""

    ca: Path
    ca_key: Path
    servers: dict[str, tuple[Path, Path]]  # host -> (certificate, key)
    client: tuple[Path, Path]
    token: Path


def parse_hosts(spec: str) -> list[str]:
    hosts = [h.strip() for h in spec.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--hosts needs at least one host name or IP address")
    for host in hosts:
        if not _is_ip(host) and not re.fullmatch(r"(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?", host):
            raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return hosts


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        if _is_ip(name):
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        else:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specexec"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )


def make_ca(days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    name = _name("specexec private CA")
    cert = (
        _builder(name, name, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    *,
    names: list[str] | None,
    client: bool,
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate (SANs `names`) or a client certificate (`client=True`)."""
    key = _key()
    builder = (
        _builder(_name(common_name), ca.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, private: bool) -> None:
    """Private files are created with mode 0600 (never briefly world-readable)."""
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def server_file_stem(host: str) -> str:
    return "server-" + re.sub(r"[^A-Za-z0-9_.-]", "_", host.replace("*", "wildcard"))


def generate(out: Path, hosts: list[str], *, days: int = 825, force: bool = False) -> Issued:
    """Write ca.pem, ca-key.pem, server-HOST.pem / server-HOST-key.pem per host, client.pem,
    client-key.pem and token into `out`. Existing files are kept (an error) unless `force`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    stems = [server_file_stem(h) for h in hosts]
    files = [*CA_FILES, *CLIENT_FILES, TOKEN_FILE, *(f"{s}{e}" for s in stems for e in (".pem", "-key.pem"))]
    existing = [f for f in files if (out / f).exists()]
    if existing and not force:
        raise ValueError(f"{out} already holds {', '.join(existing)}; pass --force to replace them")

    ca, ca_key = make_ca(days)
    _write(out / "ca.pem", _cert_pem(ca), private=False)
    _write(out / "ca-key.pem", _key_pem(ca_key), private=True)
    servers = {}
    for host, stem in zip(hosts, stems, strict=True):
        cert, key = make_leaf(ca, ca_key, host, names=[host, *ALWAYS_NAMES], client=False, days=days)
        paths = (out / f"{stem}.pem", out / f"{stem}-key.pem")
        _write(paths[0], _cert_pem(cert), private=False)
        _write(paths[1], _key_pem(key), private=True)
        servers[host] = paths
    cert, key = make_leaf(ca, ca_key, "specexec client", names=None, client=True, days=days)
    client = (out / "client.pem", out / "client-key.pem")
    _write(client[0], _cert_pem(cert), private=False)
    _write(client[1], _key_pem(key), private=True)
    _write(out / TOKEN_FILE, (secrets.token_urlsafe(32) + "\n").encode(), private=True)
    return Issued(out / "ca.pem", out / "ca-key.pem", servers, client, out / TOKEN_FILE)
