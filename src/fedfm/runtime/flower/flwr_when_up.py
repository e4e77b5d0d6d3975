"""Flower's ``flwr`` CLI started ahead of its SuperLink.

``python -m fedfm.runtime.flower.flwr_when_up HOST PORT WAIT_S [--after FILE] ARGS...``
imports the CLI (seconds of imports), waits until ``HOST:PORT`` accepts connections (and
``FILE`` exists: e.g. the run config, written once ``fedfm serve`` has checked it), then
runs ``flwr ARGS...`` as the ``flwr`` command does. ``fedfm serve`` starts ``flwr run``
this way while the SuperLink starts (ours: Flower starts its CLI only once it is called).
It exits with code 1 when nothing listens within ``WAIT_S`` seconds, or when the process
that started it ends before ``FILE`` exists.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` now."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def main(argv: list[str] | None = None) -> None:
    """Runs ``flwr ARGS`` once ``HOST:PORT`` listens (see the module's docstring)."""
    parent = os.getppid()
    host, port, wait_s, *args = sys.argv[1:] if argv is None else argv
    after = None
    if args[:1] == ["--after"]:
        after, args = Path(args[1]), args[2:]
    from flwr.cli.app import app

    deadline = time.monotonic() + float(wait_s)
    while not listening(host, int(port)):
        if time.monotonic() > deadline:
            print(f"nothing listens on {host}:{port} after {float(wait_s):.0f} s", flush=True)
            sys.exit(1)
        time.sleep(0.05)
    while after is not None and not after.exists():
        if os.getppid() != parent:  # whoever was to write it is gone
            sys.exit(1)
        time.sleep(0.02)
    sys.argv = ["flwr", *args]
    sys.exit(app())


if __name__ == "__main__":
    main()
