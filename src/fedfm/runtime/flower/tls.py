"""Certificates and keys for TLS and node authentication between SuperLink and SuperNodes."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """Certificate files for TLS between SuperLink, SuperNodes and the CLI.

    Attributes:
        ca_cert: The CA certificate (SuperNodes and the CLI trust it).
        server_cert: The SuperLink's certificate, signed by the CA.
        server_key: The SuperLink's private key.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_certificates(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """Creates a CA and a SuperLink certificate for ``hosts`` (IP addresses or DNS names).

    For tests and private deployments; a deployment with a real CA uses its files instead.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fedfm test CA"))
        .issuer_name(name("fedfm test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Creates a SuperNode's EC key pair for node authentication.

    Returns:
        ``(private_key_pem, public_key_openssh)``: the SuperNode keeps the first, the
        SuperLink's operator registers the second with ``flwr supernode register``.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv = folder / f"{name}.key"
    pub = folder / f"{name}.pub"
    # OpenSSH formats, as `ssh-keygen -t ecdsa -b 384` writes them: what Flower parses.
    priv.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    priv.chmod(0o600)
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return priv, pub


def tls_files(
    certificates: Path | None = None,
    ssl_ca_certfile: Path | None = None,
    ssl_certfile: Path | None = None,
    ssl_keyfile: Path | None = None,
    insecure: bool = False,
) -> TlsFiles | None:
    """The SuperLink's TLS files from a folder or from the three paths; None if insecure.

    Raises:
        ConfigError: Neither TLS files nor ``insecure``, both, or a missing file.
    """
    given = [ssl_ca_certfile, ssl_certfile, ssl_keyfile]
    if certificates is not None:
        given = [certificates / "ca.crt", certificates / "server.pem", certificates / "server.key"]
    if insecure:
        if any(given):
            raise ConfigError("insecure", "TLS files given together with --insecure")
        return None
    if not all(given):
        raise ConfigError(
            "tls",
            "give --certificates DIR or all of --ssl-ca-certfile, --ssl-certfile,"
            " --ssl-keyfile (or --insecure to run without TLS)",
        )
    files = TlsFiles(*[Path(p) for p in given])  # type: ignore[arg-type]
    for p in (files.ca_cert, files.server_cert, files.server_key):
        if not p.exists():
            raise ConfigError("tls", f"file not found: {p}")
    return files
