"""What ``fedfm serve`` starts ahead of the run: the warm ServerApp process.

Flower starts the ServerApp only once the run is submitted: the SuperLink's SuperExec polls
for it and starts a ``flwr-serverapp`` process, which then imports Flower, torch and fedfm
(seconds, one after the other). ``fedfm serve`` starts a ServerApp process of its own
(:mod:`fedfm.runtime.flower_app.server_worker`) before it checks the config, so that these
imports run beside its own; once the SuperLink is started (``--isolation process``: no
SuperExec), :meth:`ServerWorker.go` tells the process where the SuperLink is, and it runs
the run's ServerApp task with Flower's own ServerApp runtime.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from fedfm.runtime.flower.processes import DeployError, FlwrCall, Proc, strip_ansi

SERVER_WORKER_MODULE = "fedfm.runtime.flower_app.server_worker"

#: How long ``flwr run`` may go on after the ServerApp process ended (it then only waits for
#: the rest of the run's log stream) before serve calls the run failed.
AFTER_SERVERAPP_S = 10.0


class ServerWorker:
    """A started, waiting ServerApp process (see the module's docstring).

    Use :meth:`start`, then :meth:`go` once the SuperLink is started, or :meth:`cancel`
    (also on leaving it as a context manager).
    """

    def __init__(self, popen: subprocess.Popen, early: IO[bytes]) -> None:
        self.popen = popen
        self.early = early  # its output until :meth:`go` (import errors)
        self.proc: Proc | None = None

    @classmethod
    def start(cls, die_with_parent: bool = True) -> ServerWorker:
        """Starts the process (it imports, then waits for :meth:`go`)."""
        from fedfm.runtime.flower.processes import _die_with_parent

        early = tempfile.TemporaryFile()  # noqa: SIM115 (closed by cancel)
        hook = _die_with_parent if die_with_parent and sys.platform == "linux" else None
        popen = subprocess.Popen(
            [sys.executable, "-m", SERVER_WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=early,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=hook,
        )
        return cls(popen, early)

    def __enter__(self) -> ServerWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def go(
        self,
        address: str,
        root_certificates: Path | None,
        env: Mapping[str, str],
        path: Sequence[str],
        log_dir: Path,
    ) -> Proc:
        """Hands the process the SuperLink's runtime API (``host:port``) and its
        environment; the process, as a :class:`Proc` with its log in ``log_dir``.

        Raises:
            DeployError: It ended before (e.g. an import failed).
        """
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / "serverapp.log"
        log.touch()
        self.proc = Proc("serverapp", self.popen, log)
        go = {
            "address": address,
            "root_certificates": None if root_certificates is None else str(root_certificates),
            "env": dict(env),
            "path": list(path),
            "log": str(log),
        }
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((json.dumps(go) + "\n").encode())
            self.popen.stdin.close()
        except OSError:
            pass  # it ended: said below
        if self.popen.poll() is not None:
            code = self.popen.returncode
            raise DeployError(f"the ServerApp process exited ({code}):\n{self.output()}")
        return self.proc

    def output(self) -> str:
        """What the process printed before :meth:`go` (its last lines)."""
        self.early.seek(0)
        text = self.early.read().decode(errors="replace")
        return "\n".join(strip_ansi(text).splitlines()[-20:])

    def cancel(self) -> None:
        """Ends the process unless it was handed the run (then it ends with the run)."""
        if self.proc is None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()
            self.popen.wait()
        self.early.close()


def wait_run(call: FlwrCall, server: Proc, timeout_s: float | None) -> str:
    """Waits for ``flwr run`` as :meth:`FlwrCall.wait` does, and also for the ServerApp
    process: when it has ended and ``flwr run`` has not :data:`AFTER_SERVERAPP_S` later
    (Flower's SuperExec no longer restarts or reports it), the run failed.

    Raises:
        DeployError: The run failed or timed out, or the ServerApp process ended first.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ended: float | None = None
    while call.popen.poll() is None:
        if deadline is not None and time.monotonic() >= deadline:
            break
        if not server.alive():
            ended = ended or time.monotonic()
            if time.monotonic() - ended > AFTER_SERVERAPP_S:
                call.kill()
                raise DeployError(
                    f"the ServerApp process exited ({server.popen.returncode}) before the run"
                    f" ended:\n{strip_ansi(server.tail(20))}"
                )
        time.sleep(0.1)
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    return call.wait(left)
