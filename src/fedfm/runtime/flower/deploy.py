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

import ipaddress
import json
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from fedfm.config import RunConfig
from fedfm.errors import ConfigError
from fedfm.runtime.flower import startup
from fedfm.runtime.flower.options import FlowerOptions, import_plugins, run_options
from fedfm.runtime.flower.payload import MESSAGE_TYPE, PAYLOAD_KEY, SESSIONS_FILE, Payload
from fedfm.runtime.flower.processes import (
    DeployError,
    FlwrCall,
    Proc,
    Stopped,
    bin_path,
    free_port,
    plugin_pythonpath,
    process_env,
    start,
    stop,
    stop_on_signals,
    strip_ansi,
    wait_port,
    with_pythonpath,
)
from fedfm.runtime.flower.refusals import RETRYING, Refusal, from_supernode_log, probe
from fedfm.runtime.flower.startup import ServerWorker, WarmWorker, wait_run
from fedfm.runtime.flower.tls import LOOPBACK_HOSTS, TlsFiles, certificate_hosts, covers

APP_NAME = "fedfm-flower-app"

CONNECTION = "fedfm"

#: The SuperNode command fedfm runs: Flower's ``flower-supernode`` with paced polls.
SUPERNODE_MODULE = "fedfm.runtime.flower.supernode"


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
    isolation: str = "subprocess",
) -> list[str]:
    """The ``flower-superlink`` command line.

    Args:
        host: Address the SuperLink listens on.
        port: Its port (Fleet and Control APIs for SuperNodes and ``flwr``).
        tls: Certificates; None runs without TLS (``--insecure``).
        node_auth: Accept only SuperNodes whose public key was registered.
        runtime_port: Port of the ServerApp's runtime API on 127.0.0.1 (default: Flower's).
        isolation: ``"subprocess"``: the SuperLink starts Flower's SuperExec, which starts a
            ServerApp process per run; ``"process"``: a ServerApp process started apart
            takes the run (``fedfm serve``'s, :mod:`fedfm.runtime.flower.startup`).
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
    if isolation != "subprocess":
        cmd += ["--isolation", isolation]
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
    """The command of the fedfm warm worker serving a SuperNode's runtime API (woken on
    ``wake_port`` by a paced SuperNode)."""
    return startup.worker_command(runtime_port, wake_port)


def start_superlink(
    home: Path,
    log_dir: Path,
    host: str = "0.0.0.0",
    port: int = 9092,
    tls: TlsFiles | None = None,
    node_auth: bool = False,
    env_extra: Mapping[str, str] | None = None,
    wait_s: float | None = 60.0,
    die_with_parent: bool = False,
    isolation: str = "subprocess",
) -> Proc:
    """Starts a SuperLink and waits until it listens.

    Args:
        wait_s: How long to wait for it to listen; None: return at once (then call
            :func:`wait_superlink`).
        isolation: How the SuperLink's ServerApp runs (see :func:`superlink_command`).

    Raises:
        DeployError: It exited or did not listen in time.
    """
    env = process_env(home, env_extra)
    cmd = superlink_command(host, port, tls, node_auth, isolation=isolation)
    proc = start("superlink", cmd, env, log_dir, die_with_parent)
    if wait_s is not None:
        wait_superlink(proc, host, port, wait_s)
    return proc


def wait_superlink(proc: Proc, host: str, port: int, wait_s: float = 60.0) -> None:
    """Waits until a started SuperLink listens (stops it if it does not).

    Raises:
        DeployError: It exited or did not listen in time.
    """
    try:
        wait_port(_connect_host(host), port, wait_s, proc)
    except DeployError:
        stop([proc])
        raise


_ANY_ADDRESS = ("0.0.0.0", "::", "")


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in _ANY_ADDRESS else host


def own_host(host: str, tls: TlsFiles | None, field: str = "certificates") -> str:
    """The name by which ``fedfm serve`` reaches the SuperLink it started (to register the
    node keys and submit the run): ``host`` itself, or for a SuperLink on every address
    (``0.0.0.0``) 127.0.0.1, localhost, or an address of this machine. With TLS it must be
    a name the SuperLink's certificate covers, since the connection checks it.

    Raises:
        ConfigError: The certificate covers none of them (one line naming the host; checked
            before anything starts).
    """
    names = [host] if host not in _ANY_ADDRESS else [*LOOPBACK_HOSTS]
    if tls is None:
        return _connect_host(names[0])
    covered = certificate_hosts(tls.server_cert)
    if host in _ANY_ADDRESS:
        names += [h for h in covered if _is_local_address(h)]
    for name in names:
        if covers(covered, name):
            return name
    raise ConfigError(
        field,
        f"the SuperLink's certificate {tls.server_cert} is not valid for {names[0]}, where"
        f" `fedfm serve` reaches its own SuperLink (it is valid for"
        f" {', '.join(covered) or 'no host name'}): make it with `fedfm flower-certs`, which"
        f" adds 127.0.0.1 and localhost, or add {names[0]} to its host names",
    )


def _is_local_address(host: str) -> bool:
    """Whether ``host`` is an IP address of this machine (a socket can bind to it)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((str(ip), 0))
    except OSError:
        return False
    return True


def node_public_keys(paths: Sequence[Path]) -> list[bytes]:
    """The SuperNode public keys (OpenSSH EC keys, as ``fedfm flower-certs`` writes them) in
    the form the SuperLink registers, read before anything starts.

    Raises:
        ConfigError: A file is not such a key (field ``node-key``).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    out = []
    for path in paths:
        try:
            key = serialization.load_ssh_public_key(path.read_bytes())
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError("node-key", f"{path} is not an OpenSSH public key ({e})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ConfigError("node-key", f"{path} is not an EC public key")
        out.append(public_key_to_bytes(key))
    return out


def import_control_client() -> tuple[Any, Any, Any, Any]:
    """Flower's Control API client and what a registration request needs (about a second
    of imports: done while the SuperLink starts)."""
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.proto.control_pb2 import RegisterNodeRequest
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor

    return (
        CliClientHttpInterceptor,
        RegisterNodeRequest,
        ControlHttpClient,
        RuntimeVersionHttpInterceptor,
    )


def register_nodes(
    address: str, root_certificates: Path | None, public_keys: Sequence[Path]
) -> None:
    """Registers SuperNode public keys with the SuperLink at ``address`` (node
    authentication), all over one connection from this process: what ``flwr supernode
    register KEY`` does, without starting the ``flwr`` CLI (about 2 s) for every key.

    Raises:
        DeployError: The SuperLink did not register a key.
    """
    CliClientHttpInterceptor, RegisterNodeRequest, ControlHttpClient, VersionInterceptor = (
        import_control_client()
    )
    keys = node_public_keys(public_keys)
    control = ControlHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=None if root_certificates is None else root_certificates.read_bytes(),
        interceptors=[
            CliClientHttpInterceptor(),
            VersionInterceptor(component_name="flwr CLI"),
        ],
    )
    try:
        for path, key in zip(public_keys, keys, strict=True):
            try:
                reply = control.RegisterNode(request=RegisterNodeRequest(public_key=key))
            except Exception as e:  # Flower's HTTP and protocol errors alike
                raise DeployError(f"the SuperLink did not register {path}: {e}") from None
            if not reply.node_id:
                raise DeployError(f"the SuperLink did not register {path}")
    finally:
        control.close()


def start_submit(
    home: Path,
    work: Path,
    payload: Payload,
    env_extra: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    echo: bool | Callable[[str], None] = False,
    when_up: tuple[str, int, float] | None = None,
) -> FlwrCall:
    """Submits a fedfm run to the SuperLink of ``$FLWR_HOME/config.toml`` with ``flwr run
    --stream``; returns at once (wait for it with :meth:`FlwrCall.wait`). With ``when_up``
    the CLI starts now and submits once the SuperLink listens (see :class:`FlwrCall`)."""
    app = write_app(work / "app")
    run_config = write_run_config(work / "run_config.toml", payload)
    env = process_env(home, env_extra)
    args = ["run", str(app), CONNECTION, "--run-config", str(run_config), "--stream"]
    return FlwrCall(args, env, work, log_path, echo, when_up)


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
    return start_submit(home, work, payload, env_extra, echo=echo).wait(timeout_s)


# Flower's log lines ("INFO :      text"), as ``flwr run --stream`` shows them.
_FLOWER_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*(.*)$", re.S)
# What the ``flwr`` CLI says of itself around a run (flwr 1.42).
_FLOWER_CLI = ("Using SuperLink", "Successfully installed", "Successfully started run")
_QUIET = ("DEBUG", "INFO")


def show_warnings(line: str) -> None:
    """Prints a line of the run's stream unless it is Flower's own chatter.

    Kept: what the ServerApp's fedfm code says (its warnings reach the stream as bare lines:
    a client that failed, one that never connected), tracebacks, and Flower's warnings and
    errors (as ``WARNING text``). Left to the log file: Flower's ``INFO`` and ``DEBUG``
    lines and the CLI's ``Using SuperLink``, ``Successfully installed`` and ``Successfully
    started run``.
    """
    text = strip_ansi(line).rstrip()
    m = _FLOWER_LEVEL.match(text)
    if not text.strip() or text.startswith(_FLOWER_CLI) or (m and m.group(1) in _QUIET):
        return
    print(f"{m.group(1)} {m.group(2)}" if m else text, file=sys.stderr, flush=True)


#: Where ``fedfm serve`` keeps the logs of the Flower processes it ran, in the run folder.
LOGS_DIR = "flower_logs"


def keep_logs(logs: Path, run_dir: Path, started: float) -> Path | None:
    """Copies this session's Flower logs (SuperLink, ``flwr run``) into
    ``run_dir/flower_logs/<start time>/``, when this session wrote the run folder.

    Returns:
        The folder they went to, or None.
    """
    sessions = run_dir / SESSIONS_FILE
    if not logs.is_dir() or not sessions.exists() or sessions.stat().st_mtime < started:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    dest = run_dir / LOGS_DIR / stamp
    dest.mkdir(parents=True, exist_ok=True)
    for log in logs.glob("*.log"):
        shutil.copyfile(log, dest / log.name)
    return dest


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
    server: ServerWorker | None = None,
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
        echo: Print what fedfm's ServerApp says as the run streams (see
            :func:`show_warnings`; Flower's own lines go to the log files only).
        work_dir: Folder for the SuperLink's home and logs (default: a temporary one).
        progress: Show each round as the run folder logs it, then the final table (as
            ``fedfm run`` does), and the clients that took no part.
        server: The ServerApp process, started ahead (see
            :mod:`fedfm.runtime.flower.startup`); None: started here.

    Returns:
        The run summary.

    Raises:
        DeployError: A process failed, or the run ended without a summary.
        Stopped: SIGTERM or SIGINT: every process this started is stopped, the temporary
            folder removed, and one line says the round the run can resume from.
    """
    started = time.time()  # the session starts here (start_s_this_session)
    opts = run_options(cfg, options)
    if node_keys and tls is None:
        raise ConfigError("node-key", "node authentication needs TLS (Flower refuses it without)")
    own = own_host(host, tls)
    node_public_keys(node_keys)  # a bad key file is one line before anything starts
    import_plugins(opts.imports)
    from fedfm.engine import resolve  # the algorithms and tasks: torch

    # The algorithm's and the task's own sections are checked by the ServerApp too; a bad
    # value is one line here, before a SuperLink starts.
    resolve(cfg)
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    # The ServerApp runs in another process: give it an absolute run folder.
    cfg = cfg.model_copy(update={"out_dir": str(run_dir.parent)})
    payload = Payload(
        config=cfg.model_dump(mode="json"),
        options=opts.model_dump(),
        resume=resume,
        overwrite=overwrite,
        started_at=started,
    )
    env_extra = with_pythonpath({}, plugin_pythonpath(opts.imports))
    from fedfm.runtime.flower.watch import RunWatch  # the run display: torch, rich

    watch = RunWatch(cfg, run_dir, resume, _task_primary(cfg), enabled=progress)
    if resume:
        print(watch.resume_line(), file=sys.stderr, flush=True)
    worker = server or ServerWorker.start()
    try:
        with stop_on_signals(), tempfile.TemporaryDirectory(prefix="fedfm-serve-") as tmp:
            work = work_dir or Path(tmp)
            home = work / "flwr-home"
            logs = work / "logs"
            link = start_superlink(
                home, logs, host, port, tls, bool(node_keys), env_extra, None, True, "process"
            )
            finished = False
            running = [link]
            try:
                address = f"{own}:{port}"
                ca = tls.ca_cert if tls else None
                write_connection(home, address, ca)
                # The ServerApp process takes the run as soon as `flwr run` submits it.
                env = process_env(home, env_extra)
                running.append(worker.go(address, ca, env, plugin_pythonpath(opts.imports), logs))
                with watch:
                    # Started together: the SuperLink; the `flwr run` CLI, which submits once
                    # the SuperLink listens; and the key registration, ready to go then. The
                    # ServerApp waits for the SuperNodes anyway.
                    flwr_run = start_submit(
                        home, work, payload, env_extra, logs / "flwr-run.log",
                        show_warnings if echo else False, (own, port, 60.0),
                    )  # fmt: skip
                    try:
                        if node_keys:
                            import_control_client()
                        wait_superlink(link, host, port)
                        if node_keys:
                            register_nodes(address, ca, node_keys)
                        out = wait_run(flwr_run, running[-1], timeout_s)
                        finished = True
                    except BaseException:
                        flwr_run.kill()
                        raise
            finally:
                # A finished run leaves the SuperLink nothing to keep: a short grace. A
                # stopped one gives the ServerApp time to end its round's writes.
                stop(running, grace_s=1.0 if finished else 5.0)
                keep_logs(logs, run_dir, started)
    except Stopped as e:
        # Everything this command started is stopped and its temporary folder is gone.
        print(watch.stop_line(e.signum), file=sys.stderr, flush=True)
        raise
    finally:
        worker.cancel()  # when it never got the run
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
        """Follows a started SuperNode (and its worker) through its log until it needs a
        restart.

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
