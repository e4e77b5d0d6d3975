"""The client side of Flower's deployment engine: ``fedfm client``.

``fedfm client`` (:func:`client`) starts one SuperNode per client on the client machines,
each with its own partition (node config ``partition-id``), and follows it across server
sessions. By default a SuperNode runs in Flower's ``process`` isolation with a fedfm *warm
worker* (:mod:`fedfm.runtime.flower_app.worker`) next to it (see
:mod:`fedfm.runtime.flower.deploy`). The server side, ``fedfm serve``, is
:func:`fedfm.runtime.flower.deploy.serve`.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fedfm.errors import ConfigError
from fedfm.runtime.flower import startup
from fedfm.runtime.flower.payload import MESSAGE_TYPE
from fedfm.runtime.flower.processes import (
    Proc,
    bin_path,
    free_port,
    process_env,
    start,
    stop,
    stop_on_signals,
    strip_ansi,
)
from fedfm.runtime.flower.refusals import RETRYING, Refusal, from_supernode_log, probe
from fedfm.runtime.flower.startup import WarmWorker

#: The SuperNode command fedfm runs: Flower's ``flower-supernode`` with paced polls.
SUPERNODE_MODULE = "fedfm.runtime.flower.supernode"


def supernode_command(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    runtime_port: int,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
    paced: bool = True,
    device: str | None = None,
    wake_port: int | None = None,
) -> list[str]:
    """The ``flower-supernode`` command line of one fedfm client.

    Args:
        superlink: The SuperLink's ``host:port``.
        partition_id: Index of the client this node serves.
        num_partitions: Number of clients of the run.
        runtime_port: Port of this node's runtime API on 127.0.0.1 (unique per machine).
        root_certificates: The CA certificate to trust; None connects without TLS.
        auth_key: This node's private key, when the SuperLink authenticates nodes.
        state_dir: Folder for this node's client-state snapshots (resume).
        isolation: ``"process"`` (a fedfm warm worker serves the ClientApp) or
            ``"subprocess"`` (Flower starts a ClientApp process per message).
        paced: Run Flower's SuperNode with fedfm's short polls
            (:mod:`fedfm.runtime.flower.supernode`); False runs ``flower-supernode`` as
            Flower ships it (a 3 s pause after every empty poll).
        device: The ``device`` this node computes on in place of the run's (node config
            ``device``); None: the run's.
        wake_port: UDP port on 127.0.0.1 of the node's warm worker, woken once a message
            is in (paced only; see :mod:`fedfm.runtime.flower.pacing`).
    """
    node_config = f"partition-id={partition_id} num-partitions={num_partitions}"
    if state_dir is not None:
        node_config += f' state-dir="{state_dir.resolve()}"'
    if device is not None:
        node_config += f' device="{device}"'
    exe = [sys.executable, "-m", SUPERNODE_MODULE] if paced else [bin_path("flower-supernode")]
    if paced and wake_port is not None:
        exe += ["--wake-port", str(wake_port)]
    cmd = [*exe, "--superlink", superlink, "--node-config", node_config]
    cmd += ["--host", "127.0.0.1", "--port", str(runtime_port), "--isolation", isolation]
    cmd += (
        ["--insecure"]
        if root_certificates is None
        else ["--root-certificates", str(root_certificates)]
    )
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def worker_command(runtime_port: int, wake_port: int | None = None) -> list[str]:
    """The command of the fedfm warm worker serving a SuperNode's runtime API.

    A paced SuperNode wakes the worker on ``wake_port``.
    """
    return startup.worker_command(runtime_port, wake_port)


def start_client(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    home: Path,
    log_dir: Path,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
    env_extra: Mapping[str, str] | None = None,
    name: str | None = None,
    die_with_parent: bool = False,
    paced: bool = True,
    device: str | None = None,
    worker: WarmWorker | None = None,
) -> list[Proc]:
    """Starts the SuperNode of one client (and its warm worker); returns without waiting.

    Args:
        superlink: The SuperLink's ``host:port``.
        partition_id: Index of the client this node serves (``0 .. num_partitions-1``).
        num_partitions: Number of clients of the run.
        home: ``FLWR_HOME`` of this node.
        log_dir: Folder of its logs.
        root_certificates: CA certificate to trust (TLS); None connects without TLS.
        auth_key: This node's private key when the SuperLink authenticates nodes.
        state_dir: Folder for its client-state snapshots (resume); default under ``home``.
        isolation: ``"process"`` (warm worker) or ``"subprocess"`` (Flower's own).
        env_extra: Extra environment variables (e.g. ``PYTHONPATH`` for plugins).
        name: Name of the node's processes and logs (default ``supernode-<partition>``).
        die_with_parent: End the processes with the calling thread (see :func:`start`).
        paced: Shorten the SuperNode's polls (see :func:`supernode_command`).
        device: The node's own ``device`` (see :func:`supernode_command`).
        worker: Its warm worker, started ahead (:func:`startup.start_warm_worker`); None:
            started here (``process`` isolation).

    Returns:
        The started processes (stop them with :func:`stop`).
    """
    if isolation not in ("process", "subprocess"):
        raise ConfigError("isolation", f"'{isolation}' is not 'process' or 'subprocess'")
    env = process_env(home, env_extra)
    runtime_port = worker.runtime_port if worker else free_port()
    # A paced SuperNode wakes its warm worker when a message is in (no 50 ms task polls).
    wake_port = free_port(udp=True) if paced and isolation == "process" else None
    wake_port = worker.wake_port if worker else wake_port
    state = state_dir or home / "client-states"
    cmd = supernode_command(
        superlink,
        partition_id,
        num_partitions,
        runtime_port,
        root_certificates,
        auth_key,
        state,
        isolation,
        paced,
        device,
        wake_port,
    )
    name = name or f"supernode-{partition_id}"
    node = start(name, cmd, env, log_dir, die_with_parent)
    procs = [node]
    if worker is not None:
        procs.append(worker.proc)
    elif isolation == "process":
        wcmd = [*worker_command(runtime_port, wake_port), "--parent-pid", str(node.popen.pid)]
        procs.append(start(f"{name}-worker", wcmd, env, log_dir, die_with_parent))
    return procs


#: How long ``fedfm client`` waits for its first session (the server may start after the
#: clients, and registers their keys once it is up), and for a SuperLink that keeps refusing
#: its key, before it gives up with exit code 2.
WAIT_S = 120.0


def client(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
    work_dir: Path | None = None,
    wait_s: float = WAIT_S,
    device: str | None = None,
) -> int:
    """Runs one client's SuperNode until interrupted (``fedfm client``).

    The client waits for a SuperLink that answers as it expects (TLS or not, a certificate
    that verifies), starts its SuperNode and says in one line each what happens: ``waiting
    for the server``, ``connected``, ``served round N``, ``server session ended; waiting for
    the next``. A SuperNode that the SuperLink refuses, or that fails, is started again after
    a short pause. It gives up with code 2 on a mismatch that retrying cannot fix (at once),
    and after ``wait_s`` seconds without a SuperLink that accepts it, counted from the start
    until the first session and from the first refusal of its key later (between sessions
    it waits for the next one without limit). SIGTERM and SIGINT stop the SuperNode and its
    worker, remove the temporary folder and raise
    :class:`~fedfm.runtime.flower.processes.Stopped`.

    ``device`` is what this machine computes on in place of the run's device (``fedfm client
    --device``; checked by the caller).

    Returns:
        2: a refusal retrying cannot fix, or the wait ran out.
    """
    with (
        stop_on_signals(),
        tempfile.TemporaryDirectory(prefix="fedfm-client-") as tmp,
        startup.WorkerAhead() as ahead,
    ):
        work = work_dir or Path(tmp)
        node = _ClientNode(superlink, partition_id, root_certificates, wait_s)
        state = state_dir or Path("fedfm-client-states") / str(partition_id)
        logs = work / "logs"

        def prestart() -> None:  # before the first session: the worker imports meanwhile
            if isolation == "process" and not node.served_once:
                name = f"supernode-{partition_id}"
                ahead.start(work / "flwr-home", logs, name, die_with_parent=True)

        named = False
        while True:
            if (code := node.wait_for_server(prestart)) is not None:
                return code
            if not named:  # once, as the first SuperNode starts: the folder goes at the end
                named = True
                print(
                    f"client {partition_id}: SuperNode for {superlink}; logs in {logs} while this"
                    " client runs",
                    flush=True,
                )
            procs = start_client(
                superlink,
                partition_id,
                num_partitions,
                work / "flwr-home",
                logs,
                root_certificates,
                auth_key,
                state,
                isolation,
                die_with_parent=True,
                device=device,
                worker=ahead.take(),
            )
            try:
                code = node.follow(procs)
            finally:
                stop(ahead.after(procs, node.served_once))
            if code is not None:
                return code
            if (code := node.pause()) is not None:
                return code


# What a SuperNode logs (flwr 1.42, ANSI colours removed), as the client follows it.
_CONNECTED = "SuperNode ID: "
_ROUND = re.compile(r"\[RUN (\d+), ROUND ([^\]]+)\]")
_REPLIED = f"Sending: {MESSAGE_TYPE} message"
# A SuperLink that does not know the node any more: a new server session started.
_UNKNOWN_NODE = "401 Unauthorized"


class _ClientNode:
    """What ``fedfm client`` knows about its SuperLink across SuperNode restarts.

    Args:
        superlink: The SuperLink's ``host:port``.
        cid: The client's partition id (for its lines).
        root_certificates: The CA the client trusts; None: no TLS.
        wait_s: See :func:`client`.
    """

    def __init__(
        self, superlink: str, cid: int, root_certificates: Path | None, wait_s: float
    ) -> None:
        self.superlink = superlink
        self.cid = cid
        self.ca = root_certificates
        self.wait_s = wait_s
        self.started = time.monotonic()
        self.served_once = False  # connected at least once: no limit on the next wait
        self.refused_since: float | None = None
        self.why = "no SuperLink answered yet"  # the reason the wait goes on, for the last line
        self.said = ""
        self.backoff = _PAUSE_S

    # ----- lines -----
    def _print(self, line: str) -> None:
        print(f"client {self.cid}: {line}", file=sys.stderr, flush=True)
        self.said = line

    def say(self, line: str) -> None:
        """Prints a status line once (not again while it stays the same)."""
        if line != self.said:
            self._print(line)

    # ----- the bounded wait -----
    def deadline(self) -> float | None:
        """When the wait runs out (monotonic clock), or None while it has no limit."""
        clocks = [] if self.served_once else [self.started]
        clocks += [] if self.refused_since is None else [self.refused_since]
        return min(clocks) + self.wait_s if clocks else None

    def left(self) -> float:
        """Seconds until the wait runs out (infinite while it has no limit)."""
        end = self.deadline()
        return float("inf") if end is None else end - time.monotonic()

    def give_up(self) -> int:
        """Prints why the wait ran out; the exit code."""
        end = self.deadline()
        waited = time.monotonic() - (end - self.wait_s if end is not None else self.started)
        self._print(f"gave up after {waited:.1f} s (--wait {self.wait_s:g}): {self.why}")
        return 2

    # ----- the steps of the client loop -----
    def wait_for_server(self, waiting: Callable[[], None] | None = None) -> int | None:
        """Probes the SuperLink until it answers as this client expects.

        Args:
            waiting: Called each time nothing answers yet (e.g. to start what can start
                before the SuperLink is up).

        Returns:
            2 for a mismatch retrying cannot fix or a wait that ran out; None once it answers.
        """
        while True:
            found = probe(self.superlink, self.ca)
            if isinstance(found, Refusal):
                self._print(found.line())
                return 2
            if found is None:
                if self.refused_since is None:  # a refusal stays the reason until connected
                    self.why = f"{self.superlink} answers, but the SuperNode has not joined it yet"
                return None
            self.why = found
            if not self.served_once:  # after a session, "waiting for the next" was said
                self.say(f"waiting for the server ({found})")
            if self.left() <= 0:
                return self.give_up()
            if waiting is not None:
                waiting()
            time.sleep(min(_PROBE_S, max(self.left(), 0.0)))

    def follow(self, procs: list[Proc]) -> int | None:
        """Follows a started SuperNode (and its worker) through its log until it needs a restart.

        Returns:
            2 to stop the client (a refusal retrying cannot fix, or the wait ran out); None
            to start a SuperNode again (the session ended, the SuperLink refused the key, a
            process failed).
        """
        log = _LogFollower(procs[0].log_path)
        connected = False
        rnd = ""
        served: set[str] = set()
        while True:
            alive = all(p.alive() for p in procs)  # before reading: no line is left unread
            for line in log.lines():
                if _CONNECTED in line:
                    connected = True
                    self.served_once, self.refused_since, self.backoff = True, None, _PAUSE_S
                    self.say("connected")
                elif m := _ROUND.search(line):
                    rnd = f"{m.group(1)}/{m.group(2)}"
                elif _REPLIED in line and rnd not in served:
                    served.add(rnd)
                    self._print(f"served round {rnd.split('/', 1)[1]}")
                elif connected and _UNKNOWN_NODE in line:
                    self.say("server session ended; waiting for the next")
                    return None
                elif RETRYING in line:
                    # The SuperNode lost (or never reached) its SuperLink. Gone: the session
                    # ended. Still there: a passing failure the SuperNode retries by itself.
                    found = probe(self.superlink, self.ca)
                    if isinstance(found, Refusal):  # e.g. the client's TLS does not match
                        self._print(found.line())
                        return 2
                    if isinstance(found, str) and connected:
                        self.say("server session ended; waiting for the next")
                        return None
                    if isinstance(found, str) and (code := self.wait_for_server()) is not None:
                        return code
            if not alive:
                return self._exited(procs, connected)
            if not connected and self.left() <= 0:
                return self.give_up()
            time.sleep(0.2)

    def _exited(self, procs: list[Proc], connected: bool) -> int | None:
        """Reports why a process of the node ended; 2 for a refusal retrying cannot fix."""
        node = procs[0]
        if node.alive():  # the worker ended on its own: a real failure
            worker = procs[-1]
            self._print(f"worker exited ({worker.popen.returncode}):\n{strip_ansi(worker.tail(8))}")
            return None
        tail = strip_ansi(node.tail(40))
        if connected and (_UNKNOWN_NODE in tail or RETRYING in tail):
            self.say("server session ended; waiting for the next")
            return None
        refusal = None if connected else from_supernode_log(tail)
        if refusal is None:
            self._print(f"SuperNode exited ({node.popen.returncode}):\n{strip_ansi(node.tail(8))}")
            return None
        if refusal.fatal:
            self._print(refusal.line())
            return 2
        self.refused_since = self.refused_since or time.monotonic()
        self.why = refusal.line()
        # At a serve's start the SuperLink is up a few seconds before it has registered the
        # keys: a refusal is a reason to wait (up to the deadline), not yet an error.
        flower = f" (Flower: {refusal.detail})" if refusal.detail else ""
        self.say(f"waiting for the server: {refusal.reason} yet{flower}")
        return None

    def pause(self) -> int | None:
        """Sleeps before the next SuperNode start (growing, never past the deadline)."""
        if self.left() <= 0:
            return self.give_up()
        time.sleep(min(self.backoff, self.left()))
        self.backoff = min(self.backoff * 2, _MAX_PAUSE_S)
        return None


_PAUSE_S = 1.0
_MAX_PAUSE_S = 8.0
# Between two probes of a SuperLink that does not answer yet (a connection attempt each).
_PROBE_S = 0.2


class _LogFollower:
    """The complete lines a process has added to its log since the last call (ANSI-free)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *done, self.partial = text.split("\n")
        return [strip_ansi(x) for x in done]
