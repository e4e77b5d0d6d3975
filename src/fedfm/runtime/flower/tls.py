"""Certificates and keys for TLS and node authentication between SuperLink and SuperNodes.

Key material is the operator's: :func:`make_key_folder` never replaces an existing CA,
SuperLink certificate or node key unless told to (``force``), and :func:`add_node_keys` adds
node keys to a folder without touching its CA and certificate. Every private key is written
with mode 600 from the moment it exists (never world-readable, even briefly), in a folder of
mode 700.

Which file goes where: ``ca.crt`` to every client machine (and the server); ``node<i>.key``
to client machine *i* only; ``node<i>.pub`` stays on the server (``fedfm serve --node-key``);
``server.key`` and ``server.pem`` stay on the server, and ``server.key`` never leaves it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm.errors import ConfigError

log = logging.getLogger("fedfm")

#: Files of a key folder made by :func:`make_certificates`.
CERT_FILES = ("ca.crt", "server.pem", "server.key")
NODE_KEY = re.compile(r"node(\d+)\.(key|pub)")
PRIVATE_MODE = 0o600
FOLDER_MODE = 0o700
#: Validity of the certificates ``fedfm flower-certs`` makes: a deployment's length.
DEFAULT_DAYS = 365
#: ``fedfm serve`` and ``fedfm client`` warn this many days before a certificate expires.
WARN_DAYS = 14
#: Names every certificate fedfm makes also covers: ``fedfm serve`` reaches its own
#: SuperLink on this machine (key registration, ``flwr run``) by one of them.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
RENEW_HINT = (
    "renew with `fedfm flower-certs DIR --renew` and give every client the new ca.crt"
    " (docs/running-across-machines.md)"
)
_DAY = dt.timedelta(days=1)


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


def make_certificates(
    folder: Path,
    hosts: Sequence[str] = LOOPBACK_HOSTS,
    days: float = DEFAULT_DAYS,
    start: dt.datetime | None = None,
    loopback: bool = True,
) -> TlsFiles:
    """Creates a CA and a SuperLink certificate for ``hosts`` (IP addresses or DNS names).

    For private deployments and tests; a deployment with a real CA uses its files instead.
    The CA's private key is not kept: renewing means a new CA (:func:`renew_certificates`).

    Args:
        folder: The key folder (created with mode 700).
        hosts: Host names and IP addresses the SuperLink's certificate is valid for.
        days: Validity of both certificates from ``start``.
        start: Start of the validity (default: five minutes ago, for clocks a little behind).
        loopback: Also cover :data:`LOOPBACK_HOSTS`, by which ``fedfm serve`` reaches its
            own SuperLink (after ``hosts``; the CA is named after the first of ``hosts``).
    """
    hosts = list(dict.fromkeys([*hosts, *(LOOPBACK_HOSTS if loopback else ())]))
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    _key_folder(folder)
    begin = start or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    end = begin + dt.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_name = name(f"fedfm CA for {hosts[0]}")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
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
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(
        files.server_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return files


def certificate_hosts(path: Path) -> list[str]:
    """The host names and IP addresses a certificate is valid for.

    Its subject alternative names, in the order they were written.
    """
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n.value) for n in sans]


def renew_certificates(folder: Path, hosts: Sequence[str] | None, days: float) -> TlsFiles:
    """Replaces a key folder's CA and SuperLink certificate; its node keys stay as they are.

    Node authentication keys are not TLS certificates: the SuperLink knows a node by the
    public key ``fedfm serve --node-key`` registers, so renewed certificates need no node
    to register again. Every client needs the new ``ca.crt``.

    Args:
        folder: A key folder made by :func:`make_key_folder`.
        hosts: Host names and addresses of the new certificate; None keeps the old ones.
        days: Validity of the new certificates.

    Raises:
        ConfigError: ``folder`` holds no SuperLink certificate to renew.
    """
    old = folder / "server.pem"
    if not old.exists():
        raise ConfigError("renew", f"{folder} holds no SuperLink certificate (server.pem) to renew")
    return make_certificates(folder, list(hosts or certificate_hosts(old)), days)


def certificate_expiry(path: Path) -> dt.datetime:
    """When the first certificate of a PEM file to expire does (UTC; bundles allowed).

    Raises:
        ConfigError: The file holds no PEM certificate.
    """
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError as e:
        raise ConfigError("tls", f"{path} is not a PEM certificate ({e})") from None
    return min(c.not_valid_after_utc for c in certs)


def check_expiry(path: Path, field: str, now: dt.datetime | None = None) -> dt.datetime:
    """Refuses an expired certificate and warns about one that expires soon.

    Args:
        path: A PEM certificate (or bundle).
        field: The option that named it, for the message (e.g. ``"root-certificates"``).
        now: The current time (default: the clock).

    Returns:
        When it expires.

    Raises:
        ConfigError: It has expired (one line: when, and how to renew).
    """
    end = certificate_expiry(path)
    left = end - (now or dt.datetime.now(dt.UTC))
    when = end.strftime("%Y-%m-%d %H:%M UTC")
    if left.total_seconds() <= 0:
        raise ConfigError(field, f"certificate {path} expired on {when}: {RENEW_HINT}")
    if left <= dt.timedelta(days=WARN_DAYS):
        log.warning(
            "certificate %s expires on %s (in %.1f days): %s", path, when, left / _DAY, RENEW_HINT
        )
    return end


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Creates a SuperNode's EC key pair for node authentication.

    Returns:
        ``(private_key_pem, public_key_openssh)``: the SuperNode keeps the first, the
        SuperLink's operator registers the second with ``flwr supernode register``.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    _key_folder(folder)
    key = ec.generate_private_key(ec.SECP384R1())
    priv = folder / f"{name}.key"
    pub = folder / f"{name}.pub"
    # OpenSSH formats, as `ssh-keygen -t ecdsa -b 384` writes them: what Flower parses.
    write_private(
        priv,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
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


def write_private(path: Path, data: bytes) -> None:
    """Writes a private key readable by its owner only (mode 600 from creation on).

    The file is created under a temporary name with mode 600 and renamed onto ``path``, so
    no other user can open it at any moment, and a replaced key is swapped in one step.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, PRIVATE_MODE)  # the umask may have narrowed it further; make it exact
    tmp.replace(path)


def _key_folder(folder: Path) -> None:
    """Creates a key folder with mode 700; an existing one open to others gets a warning."""
    if not folder.exists():
        folder.mkdir(parents=True, mode=FOLDER_MODE)
        folder.chmod(FOLDER_MODE)
        return
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o077:
        log.warning("%s is open to other users (mode %o): chmod 700 %s", folder, mode, folder)


def key_material(folder: Path) -> list[str]:
    """Names of the key files in ``folder`` that :func:`make_key_folder` would write."""
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in folder.iterdir())
    return [n for n in names if n in CERT_FILES or NODE_KEY.fullmatch(n)]


def node_indices(folder: Path) -> list[int]:
    """Indices ``i`` of the node key files ``node<i>.key`` / ``node<i>.pub`` in ``folder``."""
    found = {int(m.group(1)) for n in key_material(folder) if (m := NODE_KEY.fullmatch(n))}
    return sorted(found)


def make_key_folder(
    folder: Path, hosts: Sequence[str], nodes: int, force: bool = False, days: float = DEFAULT_DAYS
) -> tuple[TlsFiles, list[tuple[Path, Path]]]:
    """A CA, a SuperLink certificate for ``hosts`` and ``nodes`` node key pairs in ``folder``.

    Args:
        folder: The key folder (created with mode 700).
        hosts: Host names and IP addresses the SuperLink's certificate is valid for.
        nodes: Node key pairs to make (``node0`` ... ``node<nodes-1>``).
        force: Replace key material already in ``folder``.
        days: Validity of the certificates.

    Returns:
        The TLS files and the ``(private, public)`` node key paths.

    Raises:
        ConfigError: ``folder`` already holds key material and ``force`` is not set
            (replacing it would break every client set up with it).
    """
    existing = key_material(folder)
    if existing and not force:
        raise ConfigError(
            "flower-certs",
            f"{folder} already holds key material ({', '.join(existing)}): replacing it breaks"
            " every client set up with it; pass --add-nodes N to add node keys, --renew to renew"
            " the certificates (node keys kept), or --force to replace it all",
        )
    tls = make_certificates(folder, hosts, days)
    return tls, [make_node_key(folder, f"node{i}") for i in range(nodes)]


def add_node_keys(folder: Path, count: int) -> list[tuple[Path, Path]]:
    """Adds ``count`` node key pairs after the highest existing index; nothing else changes.

    Returns:
        The new ``(private, public)`` key paths.

    Raises:
        ConfigError: ``count`` is below 1.
    """
    if count < 1:
        raise ConfigError("add-nodes", f"must be at least 1, got {count}")
    start = max(node_indices(folder), default=-1) + 1
    return [make_node_key(folder, f"node{i}") for i in range(start, start + count)]


def check_private(path: Path, what: str) -> bool:
    """Warns when a private key file can be read by users other than its owner.

    Args:
        path: The key file.
        what: What it is, for the message (e.g. ``"the SuperLink's TLS key"``).

    Returns:
        Whether no other user may read it (neither group nor others have read permission).
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o044 == 0:
        return True
    log.warning("%s %s is readable by other users (mode %o): chmod 600 %s", what, path, mode, path)
    return False


def covers(hosts: Sequence[str], name: str) -> bool:
    """Whether a certificate valid for ``hosts`` is valid for ``name``.

    Whether a certificate valid for ``hosts`` (its subject alternative names) is valid
    for ``name``: an IP address equal to one of them, or a DNS name equal to one (case
    ignored) or matched by a wildcard ``*.domain`` in its leftmost label (RFC 6125).
    """
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        ip = None
    for h in hosts:
        if ip is not None:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(h) == ip:
                    return True
            continue
        pattern, want = h.lower(), name.lower().rstrip(".")
        if pattern == want:
            return True
        if pattern.startswith("*.") and "." in want and want.split(".", 1)[1] == pattern[2:]:
            return True
    return False
