"""Why a SuperNode cannot join its SuperLink, in one line, and whether retrying can help.

A SuperNode that cannot join logs Flower's reason in its own log file and either exits
(code 305, e.g. its key is not registered) or retries the connection forever (e.g. it
speaks plain gRPC to a SuperLink that requires TLS, which from the SuperNode's side looks
the same as a SuperLink that is not up yet). ``fedfm client`` reads the reason from the log
(:func:`from_supernode_log`) and, while the SuperNode keeps failing to connect, checks the
SuperLink's port itself (:func:`probe`): whether anything listens, whether it speaks TLS,
and whether its certificate verifies against the CA the client was given.
"""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

#: A line of a SuperNode's log saying it could not connect and will retry by itself.
RETRYING = "Connection attempt failed"

# "[code: 2004] Failed to activate SuperNode." in the SuperNode's log (flwr 1.42, exit 305).
_FLOWER_CODE = re.compile(r"\[code: (\d+)\] ([^\n]*)")


@dataclass(frozen=True)
class Refusal:
    """Why the SuperLink did not accept this SuperNode.

    Attributes:
        reason: One line for the console (``refused: <reason>``).
        fatal: Retrying cannot fix it (a TLS mismatch); else it may resolve (a key that
            the operator has not registered yet).
        detail: Flower's own words, when they came from its log.
    """

    reason: str
    fatal: bool
    detail: str = ""

    def line(self) -> str:
        """``refused: <reason> (<Flower's words>)``."""
        tail = f" (Flower: {self.detail})" if self.detail else ""
        return f"refused: {self.reason}{tail}"


# Flower's fleet API error codes (flwr 1.42, ``flwr.supercore.constant.ApiErrorCode``).
_CODES = {
    "2001": Refusal("the SuperLink authenticates nodes: start this client with --auth-key", True),
    "2004": Refusal("node key not registered on the SuperLink", False),
}


def from_supernode_log(text: str) -> Refusal | None:
    """The last refusal a SuperNode logged, or None if it logged none."""
    found = _FLOWER_CODE.findall(text)
    if not found:
        return None
    code, words = found[-1]
    detail = f"[code: {code}] {words.strip()}"
    known = _CODES.get(code)
    if known is None:
        return Refusal("the SuperLink did not accept this SuperNode", False, detail)
    return Refusal(known.reason, known.fatal, detail)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def probe(
    address: str, root_certificates: Path | None, timeout_s: float = 3.0
) -> Refusal | str | None:
    """Checks the SuperLink's port as this client would use it.

    Args:
        address: The SuperLink's ``host:port``.
        root_certificates: The CA certificate the client trusts; None: the client connects
            without TLS.
        timeout_s: Timeout of each connection attempt.

    Returns:
        A :class:`Refusal` for a mismatch that retrying cannot fix (the SuperLink speaks TLS
        and the client does not, or the other way round, or its certificate does not verify
        against the CA); a string when the SuperLink is not reachable (yet); None when the
        port answers as the client expects.
    """
    host, port = _split(address)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        return f"nothing answers at {address} ({e.strerror or e})"
    with raw:
        speaks_tls = _handshake(raw, host, None)
    if speaks_tls is not None:  # the handshake itself failed: no TLS on that port
        if root_certificates is None:
            return None
        return Refusal(
            "the SuperLink does not use TLS: start this client with --insecure, or the"
            " server with --certificates",
            True,
        )
    if root_certificates is None:
        return Refusal(
            "the SuperLink requires TLS: start this client with --root-certificates CA_FILE",
            True,
        )
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        return f"nothing answers at {address} ({e.strerror or e})"
    with raw:
        error = _handshake(raw, host, root_certificates)
    if error is None:
        return None
    return Refusal(
        f"the SuperLink's certificate does not verify against {root_certificates} ({error})",
        True,
    )


def _handshake(sock: socket.socket, host: str, ca: Path | None) -> str | None:
    """A TLS handshake on ``sock``, verifying against ``ca`` when given.

    None if it worked, else the reason it failed.
    """
    if ca is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2", "http/1.1"])  # gRPC servers insist on ALPN
    try:
        with ctx.wrap_socket(sock, server_hostname=host) as tls:
            tls.version()
    except ssl.SSLCertVerificationError as e:
        return str(e.verify_message or e)
    except (ssl.SSLError, OSError) as e:
        return str(e) or type(e).__name__
    return None
