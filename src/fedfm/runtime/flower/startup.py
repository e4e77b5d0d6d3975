"""What fedfm starts ahead of a run.

``fedfm serve``'s ServerApp process and ``fedfm client``'s warm worker.

Flower starts the ServerApp only once the run is submitted: the SuperLink's SuperExec polls
for it and starts a ``flwr-serverapp`` process, which then imports Flower, torch and fedfm
(seconds, one after the other). ``fedfm serve`` starts a ServerApp process of its own
(:mod:`fedfm.runtime.flower_app.server_worker`) first thing, so that these imports run
beside the SuperLink's start. The same process checks the run config in full once it has
imported them (:meth:`ServerWorker.check`, :func:`check_run`: the algorithms and tasks
live there), so that ``fedfm serve`` itself imports neither torch nor the algorithms and
starts its SuperLink at once; once the SuperLink is started (``--isolation process``: no
SuperExec), :meth:`ServerWorker.go` tells the process where the SuperLink is, and it runs
the run's ServerApp task with Flower's own ServerApp runtime.

A ``fedfm client`` that waits for its server likewise starts its warm ClientApp worker
(:mod:`fedfm.runtime.flower_app.worker`, torch and fedfm imports) while it waits
(:func:`start_warm_worker`), and its SuperNode once the server answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedfm.runtime.flower.processes import (
    DeployError,
    FlwrCall,
    Proc,
    free_port,
    process_env,
    start,
    stop,
    strip_ansi,
)

SERVER_WORKER_MODULE = "fedfm.runtime.flower_app.server_worker"
WORKER_MODULE = "fedfm.runtime.flower_app.worker"

#: How long ``flwr run`` may go on after the ServerApp process ended (it then only waits for
#: the rest of the run's log stream) before serve calls the run failed.
AFTER_SERVERAPP_S = 10.0


class ServerWorker:
    """A started, waiting ServerApp process (see the module's docstring).

    Use :meth:`start`; then :meth:`check` and :meth:`verdict` (the full config check);
    then :meth:`go` once the SuperLink is started, or :meth:`cancel` (also on leaving it as
    a context manager).
    """

    def __init__(self, popen: subprocess.Popen, early: IO[bytes], reply: int | None = None) -> None:
        self.popen = popen
        self.early = early  # its output until :meth:`go` (import errors)
        self.reply = reply  # the read end of its verdict pipe
        self.proc: Proc | None = None

    @classmethod
    def start(cls, die_with_parent: bool = True) -> ServerWorker:
        """Starts the process (it imports, then waits for :meth:`check` or :meth:`go`)."""
        from fedfm.runtime.flower.processes import _die_with_parent

        early = tempfile.TemporaryFile()  # noqa: SIM115 (closed by cancel)
        hook = _die_with_parent if die_with_parent and sys.platform == "linux" else None
        read, write = os.pipe()
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", SERVER_WORKER_MODULE, "--reply-fd", str(write)],
                stdin=subprocess.PIPE,
                stdout=early,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=hook,
                pass_fds=(write,),
            )
        finally:
            os.close(write)  # the child's now: its end closes when it exits
        return cls(popen, early, read)

    def __enter__(self) -> ServerWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _send(self, message: Mapping[str, Any], last: bool) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((json.dumps(message) + "\n").encode())
            self.popen.stdin.flush()
            if last:
                self.popen.stdin.close()
        except (OSError, ValueError):
            pass  # it ended (its stdin is gone): said by whoever waits for it

    def check(self, request: Mapping[str, Any]) -> None:
        """Hands the process a run config to check (:func:`check_run`) once it has imported.

        Returns at once; :meth:`verdict` waits for the answer.
        """
        self._send({"check": dict(request)}, last=False)

    def verdict(self) -> dict[str, Any]:
        """The process's answer to :meth:`check` (see :func:`check_run`).

        Raises:
            ConfigError: The config is refused (the line the check would print here).
            FedfmError: Another error fedfm raises on purpose (its message).
            DeployError: The process ended first (e.g. an import failed).
        """
        from fedfm.errors import ConfigError, FedfmError

        assert self.reply is not None
        with os.fdopen(os.dup(self.reply), "rb") as pipe:
            line = pipe.readline()
        if not line.strip():
            code = self.popen.wait()
            raise DeployError(f"the ServerApp process exited ({code}):\n{self.output()}")
        answer: dict[str, Any] = json.loads(line)
        if "config_error" in answer:
            field, reason = answer["config_error"]
            raise ConfigError(field, reason)
        if "error" in answer:
            raise FedfmError(answer["error"])
        return answer

    def go(
        self,
        address: str,
        root_certificates: Path | None,
        env: Mapping[str, str],
        path: Sequence[str],
        log_dir: Path,
    ) -> Proc:
        """Hands the process the SuperLink's runtime API (``host:port``) and its environment.

        Returns:
            The process, as a :class:`Proc` with its log in ``log_dir``.

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
        self._send(go, last=True)
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
        if self.reply is not None:
            os.close(self.reply)
            self.reply = None


def check_request(
    source: str | None,
    overrides: Sequence[str],
    resume: bool,
    options: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What :meth:`ServerWorker.check` sends.

    A config to load as ``fedfm serve`` names it (``source`` and ``overrides``), or one
    already loaded (``config``, as JSON), with the Flower options and this process's
    ``sys.path`` (where plugins are found).
    """
    return {
        "source": source,
        "overrides": list(overrides),
        "resume": resume,
        "options": dict(options),
        "config": None if config is None else dict(config),
        "sys_path": list(sys.path),
    }


def check_run(request: Mapping[str, Any]) -> dict[str, Any]:
    """The full check of a run to serve, in the ServerApp process (see :func:`check_request`).

    What ``fedfm serve`` checked before the SuperLink started, one after the other: the
    config loaded with the algorithms' keys, the rounds from the algorithm's stages, the
    plugins imported, the algorithm's and the task's own sections (:func:`fedfm.engine.resolve`).

    Returns:
        ``{"config": the run config as JSON, "primary": the task's headline metric}``, or
        ``{"config_error": [field, reason]}``, or ``{"error": message}`` (another error
        fedfm raises on purpose).
    """
    from fedfm.algorithms import algo_keys
    from fedfm.config import load_config, load_run_config
    from fedfm.engine import resolve, with_stages
    from fedfm.errors import ConfigError, FedfmError
    from fedfm.runtime.flower.options import import_plugins, run_options
    from fedfm.tasks.base import TASKS

    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    try:
        if request["config"] is None:
            source, overrides = request["source"], list(request["overrides"])
            cfg = with_stages(load_run_config(source, overrides, request["resume"], algo_keys))
        else:
            cfg = load_config(dict(request["config"]))
        import_plugins(run_options(cfg, request["options"]).imports)
        resolve(cfg)
        primary = TASKS.get(str(cfg.task.get("kind", "tabular"))).primary
        return {"config": cfg.model_dump(mode="json"), "primary": str(primary)}
    except ConfigError as e:
        return {"config_error": [e.field, e.reason]}
    except FedfmError as e:
        return {"error": str(e)}


def wait_run(call: FlwrCall, server: Proc, timeout_s: float | None) -> str:
    """Waits for ``flwr run`` as :meth:`FlwrCall.wait` does, and also for the ServerApp.

    When the ServerApp process has ended and ``flwr run`` has not :data:`AFTER_SERVERAPP_S`
    later (Flower's SuperExec no longer restarts or reports it), the run failed.

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


def worker_command(runtime_port: int, wake_port: int | None = None) -> list[str]:
    """The command of the fedfm warm worker serving a SuperNode's runtime API.

    A paced SuperNode wakes it on ``wake_port``.
    """
    cmd = [sys.executable, "-m", WORKER_MODULE]
    cmd += ["--runtime-api-address", f"127.0.0.1:{runtime_port}"]
    return cmd + ([] if wake_port is None else ["--wake-port", str(wake_port)])


@dataclass
class WarmWorker:
    """A ClientApp worker started before its SuperNode, and the ports the SuperNode must use.

    Attributes:
        proc: The worker process.
        runtime_port: The SuperNode's runtime API port on 127.0.0.1 that the worker asks.
        wake_port: The UDP port on which the SuperNode wakes it (None: it polls).
    """

    proc: Proc
    runtime_port: int
    wake_port: int | None


def start_warm_worker(
    home: Path,
    log_dir: Path,
    name: str,
    env_extra: Mapping[str, str] | None = None,
    paced: bool = True,
    die_with_parent: bool = False,
) -> WarmWorker:
    """Starts a client's warm worker ahead of its SuperNode.

    It imports torch and fedfm now and asks the runtime API (``runtime_port``) until the
    SuperNode started on it is up. It ends with this process; whoever starts the SuperNode
    stops it with the SuperNode.

    Args:
        home: ``FLWR_HOME`` of the node.
        log_dir: Folder of its log (``<name>-worker.log``).
        name: The node's name (``supernode-<partition>``).
        env_extra: Extra environment variables (see :func:`process_env`).
        paced: The SuperNode will be paced and wake the worker (a wake port).
        die_with_parent: End it with the calling thread (see :func:`start`).
    """
    runtime_port = free_port()
    wake_port = free_port(udp=True) if paced else None
    cmd = [*worker_command(runtime_port, wake_port), "--parent-pid", str(os.getpid())]
    env = process_env(home, env_extra)
    proc = start(f"{name}-worker", cmd, env, log_dir, die_with_parent)
    return WarmWorker(proc, runtime_port, wake_port)


class WorkerAhead:
    """At most one warm worker started ahead of its SuperNode.

    A context manager that stops it on the way out unless it was taken (:meth:`take`) by a
    SuperNode start.
    """

    def __init__(self) -> None:
        self.worker: WarmWorker | None = None
        self.taken: WarmWorker | None = None

    def start(self, home: Path, log_dir: Path, name: str, **kw: Any) -> None:
        """Starts one (:func:`start_warm_worker`) unless one is waiting already."""
        if self.worker is None:
            self.worker = start_warm_worker(home, log_dir, name, **kw)

    def take(self) -> WarmWorker | None:
        """The waiting worker, for a SuperNode start (see :meth:`after`), or None."""
        worker, self.worker = self.worker, None
        self.taken = worker
        return worker

    def after(self, procs: list[Proc], connected: bool) -> list[Proc]:
        """What to stop once the SuperNode of ``procs`` ended.

        All of them, except the worker taken for it when the client never connected (e.g.
        the SuperLink refused the key before serve registered it): that one waits again, its
        imports done, for the next SuperNode start (same ports).
        """
        worker, self.taken = self.taken, None
        if worker is None or connected or worker.proc not in procs or not worker.proc.alive():
            return procs
        self.worker = worker
        return [p for p in procs if p is not worker.proc]

    def __enter__(self) -> WorkerAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.worker is not None:
            stop([self.worker.proc])
            self.worker = None
