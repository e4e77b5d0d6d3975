"""Flower's deployment engine for fedfm: SuperLink, SuperNodes, runs across machines.

``fedfm serve`` (:func:`serve`) starts a SuperLink on the server machine, submits the run
with ``flwr run`` and waits for it: the ServerApp runs the fedfm engine there and writes the
run folder. ``fedfm client`` (:func:`client`) starts one SuperNode per client on the client
machines, each with its own partition (node config ``partition-id``).

By default a SuperNode runs in Flower's ``process`` isolation with a fedfm *warm worker*
(:mod:`fedfm.runtime.flower_app.worker`) next to it: one long-lived process that takes the
SuperNode's ClientApp tasks one after another, so torch, the task and the models are loaded
once per node rather than once per message (Flower's ``subprocess`` isolation starts a
``flwr-clientapp`` process for every message, about 2 s and a torch import each; it stays
available as ``isolation="subprocess"``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from fedfm.config import RunConfig
from fedfm.errors import ConfigError
from fedfm.runtime.flower.options import FlowerOptions, import_plugins, run_options
from fedfm.runtime.flower.processes import (
    DeployError,
    Proc,
    Stopped,
    bin_path,
    free_port,
    plugin_pythonpath,
    process_env,
    run_flwr,
    start,
    stop,
    stop_on_signals,
    wait_port,
    with_pythonpath,
)
from fedfm.runtime.flower.refusals import Refusal, from_supernode_log, probe, retrying
from fedfm.runtime.flower.server import SESSIONS_FILE
from fedfm.runtime.flower.tls import TlsFiles
from fedfm.runtime.flower.watch import RunWatch
from fedfm.runtime.flower.wire import PAYLOAD_KEY, Payload

APP_NAME = "fedfm-flower-app"

CONNECTION = "fedfm"


APP_PYPROJECT = f"""\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "1.0.0"
description = "fedfm experiments as a Flower app (ServerApp + ClientApp from the fedfm package)"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedfm"

[tool.flwr.app.components]
serverapp = "fedfm.runtime.flower_app:server_app"
clientapp = "fedfm.runtime.flower_app:client_app"

[tool.flwr.app.config]
{PAYLOAD_KEY} = ""
"""


def write_app(folder: Path) -> Path:
    """Writes the fedfm Flower app (a ``pyproject.toml`` naming fedfm's apps) into ``folder``.

    The app holds no code: its components are the ServerApp and ClientApp of the installed
    fedfm package, so every machine runs the fedfm version it has installed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def write_connection(home: Path, address: str, root_certificates: Path | None) -> None:
    """Writes ``$FLWR_HOME/config.toml`` with the connection ``fedfm`` to a SuperLink."""
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]"]
    lines.append(f'address = "{address}"')
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = "{root_certificates.resolve()}"')
    (home / "config.toml").write_text("\n".join(lines) + "\n")


def write_run_config(path: Path, payload: Payload) -> Path:
    """Writes the TOML file passed to ``flwr run --run-config`` (it carries the payload)."""
    path.write_text(f'{PAYLOAD_KEY} = "{payload.encode()}"\n')
    return path


def superlink_command(
    host: str = "0.0.0.0",
    port: int = 9092,
    tls: TlsFiles | None = None,
    node_auth: bool = False,
    runtime_port: int | None = None,
) -> list[str]:
    """The ``flower-superlink`` command line.

    Args:
        host: Address the SuperLink listens on.
        port: Its port (Fleet and Control APIs for SuperNodes and ``flwr``).
        tls: Certificates; None runs without TLS (``--insecure``).
        node_auth: Accept only SuperNodes whose public key was registered.
        runtime_port: Port of the ServerApp's runtime API on 127.0.0.1 (default: Flower's).
    """
    cmd = [bin_path("flower-superlink"), "--host", host, "--port", str(port)]
    cmd += ["--disable-runtime-dependency-installation"]
    if tls is None:
        cmd += ["--insecure"]
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert)]
        cmd += ["--ssl-keyfile", str(tls.server_key)]
    if node_auth:
        cmd += ["--enable-supernode-auth"]
    del runtime_port  # flwr 1.42 serves every API on one port
    return cmd


def supernode_command(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    runtime_port: int,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
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
    """
    node_config = f"partition-id={partition_id} num-partitions={num_partitions}"
    if state_dir is not None:
        node_config += f' state-dir="{state_dir.resolve()}"'
    cmd = [bin_path("flower-supernode"), "--superlink", superlink, "--node-config", node_config]
    cmd += ["--host", "127.0.0.1", "--port", str(runtime_port), "--isolation", isolation]
    cmd += (
        ["--insecure"]
        if root_certificates is None
        else ["--root-certificates", str(root_certificates)]
    )
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def worker_command(runtime_port: int) -> list[str]:
    """The command of the fedfm warm worker serving a SuperNode's runtime API."""
    return [
        sys.executable,
        "-m",
        "fedfm.runtime.flower_app.worker",
        "--runtime-api-address",
        f"127.0.0.1:{runtime_port}",
    ]


def start_superlink(
    home: Path,
    log_dir: Path,
    host: str = "0.0.0.0",
    port: int = 9092,
    tls: TlsFiles | None = None,
    node_auth: bool = False,
    env_extra: Mapping[str, str] | None = None,
    wait_s: float = 60.0,
    die_with_parent: bool = False,
) -> Proc:
    """Starts a SuperLink and waits until it listens.

    Raises:
        DeployError: It exited or did not listen in time.
    """
    env = process_env(home, env_extra)
    cmd = superlink_command(host, port, tls, node_auth)
    proc = start("superlink", cmd, env, log_dir, die_with_parent)
    try:
        wait_port(_connect_host(host), port, wait_s, proc)
    except DeployError:
        stop([proc])
        raise
    return proc


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def register_nodes(
    home: Path, public_keys: Sequence[Path], cwd: Path, env_extra: Mapping[str, str] | None = None
) -> None:
    """Registers SuperNode public keys with the SuperLink (node authentication)."""
    env = process_env(home, env_extra)
    for key in public_keys:
        run_flwr(["supernode", "register", str(key.resolve()), CONNECTION], env, 60, cwd)


def submit(
    home: Path,
    work: Path,
    payload: Payload,
    timeout_s: float | None = None,
    echo: bool = False,
    env_extra: Mapping[str, str] | None = None,
) -> str:
    """Submits a fedfm run to the SuperLink of ``$FLWR_HOME/config.toml`` and waits for it.

    Returns:
        The streamed log of the run.
    """
    app = write_app(work / "app")
    run_config = write_run_config(work / "run_config.toml", payload)
    env = process_env(home, env_extra)
    args = ["run", str(app), CONNECTION, "--run-config", str(run_config), "--stream"]
    return run_flwr(args, env, timeout_s, work, echo)


def serve(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    options: FlowerOptions | Mapping[str, Any] | None = None,
    host: str = "0.0.0.0",
    port: int = 9092,
    tls: TlsFiles | None = None,
    node_keys: Sequence[Path] = (),
    timeout_s: float | None = None,
    echo: bool = True,
    work_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs an experiment on the deployment engine: SuperLink here, SuperNodes elsewhere.

    Starts a SuperLink, registers ``node_keys`` when given (node authentication), submits
    the run and waits for it; the ServerApp writes the run folder on this machine. The
    SuperNodes (``fedfm client``) may start before or after: the server waits up to
    ``options.node_wait_s`` for them.

    Args:
        cfg: Validated run config.
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        options: Flower options.
        host: Address the SuperLink listens on.
        port: Its port.
        tls: Certificates, or None to run without TLS.
        node_keys: Public keys of the SuperNodes allowed to connect; empty: no node
            authentication.
        timeout_s: Give up on the run after this long (None: no limit).
        echo: Print the run's log as it streams.
        work_dir: Folder for the SuperLink's home and logs (default: a temporary one).
        progress: Show each round as the run folder logs it, then the final table (as
            ``fedfm run`` does), and the clients that took no part.

    Returns:
        The run summary.

    Raises:
        DeployError: A process failed, or the run ended without a summary.
        Stopped: SIGTERM or SIGINT: every process this started is stopped, the temporary
            folder removed, and one line says the round the run can resume from.
    """
    opts = run_options(cfg, options)
    if node_keys and tls is None:
        raise ConfigError("node-key", "node authentication needs TLS (Flower refuses it without)")
    import_plugins(opts.imports)
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    # The ServerApp runs in another process: give it an absolute run folder.
    cfg = cfg.model_copy(update={"out_dir": str(run_dir.parent)})
    payload = Payload(
        config=cfg.model_dump(mode="json"),
        options=opts.model_dump(),
        resume=resume,
        overwrite=overwrite,
    )
    env_extra = with_pythonpath({}, plugin_pythonpath(opts.imports))
    watch = RunWatch(cfg, run_dir, resume, _task_primary(cfg), enabled=progress)
    try:
        with stop_on_signals(), tempfile.TemporaryDirectory(prefix="fedfm-serve-") as tmp:
            work = work_dir or Path(tmp)
            home = work / "flwr-home"
            link = start_superlink(
                home,
                work / "logs",
                host,
                port,
                tls,
                bool(node_keys),
                env_extra,
                die_with_parent=True,
            )
            try:
                address = f"{_connect_host(host)}:{port}"
                write_connection(home, address, tls.ca_cert if tls else None)
                if node_keys:
                    register_nodes(home, node_keys, work, env_extra)
                with watch:
                    out = submit(home, work, payload, timeout_s, echo, env_extra)
            finally:
                stop([link])
    except Stopped as e:
        # Everything this command started is stopped and its temporary folder is gone.
        print(watch.stop_line(e.signum), file=sys.stderr, flush=True)
        raise
    summary = run_dir / "summary.json"
    if not summary.exists():
        raise DeployError(f"the run ended without a summary ({summary}):\n{out[-3000:]}")
    result = json.loads(summary.read_text())
    watch.final_table(result)
    _print_absent(run_dir)
    return dict(result)


def _task_primary(cfg: RunConfig) -> str:
    """The headline metric the config's task declares (a task may refine it once built)."""
    import fedfm.tasks  # noqa: F401  (registers the tasks)
    from fedfm.tasks.base import TASKS

    return str(TASKS.get(str(cfg.task.get("kind", "tabular"))).primary)


def _print_absent(run_dir: Path) -> None:
    """Prints the clients that took no part in the session that just ended."""
    path = run_dir / SESSIONS_FILE
    if not path.exists():
        return
    absent = json.loads(path.read_text())["sessions"][-1].get("absent") or {}
    if absent:
        who = ", ".join(f"{c} ({why})" for c, why in absent.items())
        print(f"clients that took no part: {who}", file=sys.stderr, flush=True)


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

    Returns:
        The started processes (stop them with :func:`stop`).
    """
    if isolation not in ("process", "subprocess"):
        raise ConfigError("isolation", f"'{isolation}' is not 'process' or 'subprocess'")
    env = process_env(home, env_extra)
    runtime_port = free_port()
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
    )
    name = name or f"supernode-{partition_id}"
    node = start(name, cmd, env, log_dir, die_with_parent)
    procs = [node]
    if isolation == "process":
        wcmd = [*worker_command(runtime_port), "--parent-pid", str(node.popen.pid)]
        procs.append(start(f"{name}-worker", wcmd, env, log_dir, die_with_parent))
    return procs


#: How long ``fedfm client`` keeps retrying a SuperLink that refuses its key (the operator
#: may register it after the client started) before it gives up with exit code 2.
REFUSED_WAIT_S = 120.0


def client(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
    work_dir: Path | None = None,
    restart: bool = True,
    refused_wait_s: float = REFUSED_WAIT_S,
) -> int:
    """Runs one client's SuperNode until interrupted (``fedfm client``).

    A SuperNode that exits (the SuperLink is not up yet, its key is not registered yet,
    a network failure) is started again after a growing pause, like a service manager
    would; with ``restart=False`` the first exit ends the command. Why the SuperLink refused
    the node is printed in one line (``refused: ...``, see :mod:`.refusals`); a refusal that
    retrying cannot fix (a TLS mismatch, a key the SuperLink still refuses after
    ``refused_wait_s``) ends the command with code 2. SIGTERM and SIGINT stop the SuperNode
    and its worker, remove the temporary folder and raise
    :class:`~fedfm.runtime.flower.processes.Stopped`.

    Returns:
        The SuperNode's last exit code, or 2 for a refusal that retrying cannot fix.
    """
    with stop_on_signals(), tempfile.TemporaryDirectory(prefix="fedfm-client-") as tmp:
        work = work_dir or Path(tmp)
        node = _ClientNode(superlink, partition_id, root_certificates, refused_wait_s)
        state = state_dir or Path("fedfm-client-states") / str(partition_id)
        logs = work / "logs"
        print(f"client {partition_id}: SuperNode for {superlink}; logs in {logs}", flush=True)
        if (code := node.check()) is not None:
            return code
        pause = 2.0
        while True:
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
            )
            started = time.monotonic()
            try:
                code = node.watch(procs)
            finally:
                stop(procs)
            if code is not None:
                return code
            code = int(procs[0].popen.returncode or 0)
            if (fatal := node.after_exit(procs[0], code)) is not None:
                return fatal
            if not restart:
                return code
            pause = 2.0 if time.monotonic() - started > 60 else min(pause * 2, 60.0)
            time.sleep(pause)


class _ClientNode:
    """What ``fedfm client`` knows about its SuperLink between SuperNode restarts."""

    def __init__(
        self, superlink: str, cid: int, root_certificates: Path | None, refused_wait_s: float
    ) -> None:
        self.superlink = superlink
        self.cid = cid
        self.ca = root_certificates
        self.refused_wait_s = refused_wait_s
        self.refused_since: float | None = None
        self.said = ""

    def say(self, line: str) -> None:
        """Prints a status line once (not again while it stays the same)."""
        if line != self.said:
            print(f"client {self.cid}: {line}", file=sys.stderr, flush=True)
            self.said = line

    def check(self) -> int | None:
        """Probes the SuperLink; 2 for a mismatch retrying cannot fix, else None."""
        found = probe(self.superlink, self.ca)
        if isinstance(found, Refusal):
            self.say(found.line())
            return 2
        if isinstance(found, str):
            self.say(f"waiting: {found}")
        return None

    def watch(self, procs: list[Proc]) -> int | None:
        """Waits while the node's processes live; probes the SuperLink every few seconds
        while the SuperNode retries its connection. 2 for an unfixable mismatch, else None
        once a process has exited."""
        last_probe = time.monotonic()
        while all(p.alive() for p in procs):
            time.sleep(0.5)
            if time.monotonic() - last_probe > 5 and retrying(procs[0].tail(3)):
                last_probe = time.monotonic()
                if (code := self.check()) is not None:
                    return code
        return None

    def after_exit(self, node: Proc, code: int) -> int | None:
        """Reports why the SuperNode exited; 2 once a refusal has outlasted the wait."""
        refusal = from_supernode_log(node.tail(40))
        if refusal is None:
            self.refused_since = None
            self.say(f"SuperNode exited ({code}):\n{node.tail(8)}")
            return None
        now = time.monotonic()
        self.refused_since = self.refused_since or now
        waited = now - self.refused_since
        if refusal.fatal or waited >= self.refused_wait_s:
            after = "" if refusal.fatal else f" (still refused after {waited:.0f} s)"
            self.say(refusal.line() + after)
            return 2
        self.say(f"{refusal.line()}; retrying for up to {self.refused_wait_s:g} s")
        return None


def refuse_deployment(cfg: RunConfig, *args: Any, **kw: Any) -> NoReturn:
    """The ``flower`` runtime as :func:`fedfm.runtime.run` sees it: it is never started
    implicitly, since the deployment engine needs machines and certificates.

    Raises:
        ConfigError: Always, naming the commands that run it.
    """
    raise ConfigError(
        "runtime",
        "'flower' runs across machines: start `fedfm serve` here and `fedfm client` on"
        " each client (docs/running-across-machines.md), or use runtime=flower-sim",
    )
