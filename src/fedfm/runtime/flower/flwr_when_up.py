"""Flower's ``flwr`` CLI started ahead of its SuperLink.

``python -m fedfm.runtime.flower.flwr_when_up HOST PORT WAIT_S ARGS...`` imports the CLI
(seconds of imports), waits until ``HOST:PORT`` accepts connections, then runs ``flwr
ARGS...`` as the ``flwr`` command does. ``fedfm serve`` starts ``flwr run`` this way while
the SuperLink starts (ours: Flower starts its CLI only once it is called). It exits with
code 1 when nothing listens within ``WAIT_S`` seconds.
"""

from __future__ import annotations

import socket
import sys
import time


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` now."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def main(argv: list[str] | None = None) -> None:
    """Runs ``flwr ARGS`` once ``HOST:PORT`` listens (see the module's docstring)."""
    host, port, wait_s, *args = sys.argv[1:] if argv is None else argv
    from flwr.cli.app import app

    deadline = time.monotonic() + float(wait_s)
    while not listening(host, int(port)):
        if time.monotonic() > deadline:
            print(f"nothing listens on {host}:{port} after {float(wait_s):.0f} s", flush=True)
            sys.exit(1)
        time.sleep(0.05)
    sys.argv = ["flwr", *args]
    sys.exit(app())


if __name__ == "__main__":
    main()
