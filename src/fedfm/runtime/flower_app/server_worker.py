"""A warm ServerApp process for ``fedfm serve``'s SuperLink (``--isolation process``).

With its default ``subprocess`` isolation the SuperLink starts Flower's ``flower-superexec``,
which polls for the run and then starts a ``flwr-serverapp`` process: the interpreter
starts, Flower, torch and fedfm are imported, and only then does the ServerApp begin, seconds
after the run was submitted. ``fedfm serve`` starts this process instead, first thing,
so that these imports run while the serve command checks the config and the SuperLink
starts; the SuperLink runs with ``--isolation process`` (no SuperExec of its own).

Protocol (ours): the process imports, then reads JSON lines on stdin. First, optionally,
``{"check": request}``: it checks the run config of ``request``
(:func:`fedfm.runtime.flower.startup.check_run`) and writes the verdict as one JSON line
to the file descriptor given as ``--reply-fd N``. Then ``{"address":
host:port of the SuperLink's runtime API, "root_certificates": CA file or null, "env":
variables to set, "path": folders to put first on sys.path (plugins), "log": file for
its output}``. It acquires the run's ``flwr-serverapp`` task and runs it in this process
with Flower's own ServerApp runtime (``run_serverapp``: pull the task input, install the
app, run it, push the task output, stream its output to ``flwr run``), as
``flwr-serverapp`` would, then exits. End of input before the line (``fedfm serve``
ended first): it exits with code 0, having done nothing.

Run it as ``python -m fedfm.runtime.flower_app.server_worker``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from queue import Queue
from typing import Any

#: Pause between two asks for the run's ServerApp task (it is usually there at the first).
ACQUIRE_PAUSE_S = 0.02


def acquire_token(address: str, root_certificates: bytes | None, parent_pid: int) -> str | None:
    """Asks the SuperLink's runtime API for the ``flwr-serverapp`` task until it has one.

    Returns:
        Its token, or None once ``parent_pid`` (``fedfm serve``) is gone.
    """
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    from fedfm.runtime.flower_app.worker import _client

    client = _client(address, root_certificates is None, root_certificates, None, max_tries=1)
    request = AcquireTaskRequest(supported_task_types=["flwr-serverapp"])
    try:
        while os.getppid() == parent_pid:
            try:
                res = client.AcquireTask(request)
            except Exception:  # the SuperLink is not up yet
                time.sleep(0.1)
                continue
            if res.HasField("task") and res.token:
                return str(res.token)
            time.sleep(ACQUIRE_PAUSE_S)
    finally:
        client.close()
    return None


def _redirect(log: Path) -> None:
    """Sends this process's output (fd 1 and 2) to ``log`` from now on."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def run(go: dict[str, Any], parent_pid: int) -> None:
    """Runs the run's ServerApp task as ``flwr-serverapp`` would.

    See the module's docstring for ``go``; Flower's runtime exits the process at the end.
    """
    from flwr.supercore.logger import mirror_output_to_queue
    from flwr.superlink.runtime import run_serverapp

    _redirect(Path(go["log"]))
    os.environ.update(go["env"])
    sys.path[:0] = [p for p in go["path"] if p not in sys.path]
    ca = go["root_certificates"]
    certificates = None if ca is None else Path(ca).read_bytes()
    token = acquire_token(go["address"], certificates, parent_pid)
    if token is None:
        return
    log_queue: Queue[str | None] = Queue()
    mirror_output_to_queue(log_queue)  # what the ServerApp prints goes to `flwr run --stream`
    run_serverapp(
        runtime_api_address=go["address"],
        log_queue=log_queue,
        token=token,
        insecure=certificates is None,
        certificates=certificates,
        parent_pid=parent_pid,
        runtime_dependency_install=False,
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module's docstring)."""
    args = sys.argv[1:] if argv is None else argv
    reply_fd = int(args[args.index("--reply-fd") + 1]) if "--reply-fd" in args else None
    parent_pid = os.getppid()
    # The imports of a ServerApp process, done before the run exists.
    import flwr.superlink.runtime  # noqa: F401

    import fedfm.runtime.flower_app  # noqa: F401

    line = sys.stdin.readline()
    if line.strip() and "check" in (message := json.loads(line)):
        from fedfm.runtime.flower.startup import check_run

        verdict = check_run(message["check"])
        if reply_fd is not None:
            with os.fdopen(reply_fd, "w") as reply:
                reply.write(json.dumps(verdict) + "\n")
        line = sys.stdin.readline()
    if not line.strip():
        return
    run(json.loads(line), parent_pid)


if __name__ == "__main__":
    main()
