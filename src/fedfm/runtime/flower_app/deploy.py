"""Flower's deployment engine for fedfm: SuperLink, SuperNodes, TLS, node authentication.

``fedfm serve`` (:func:`serve_main`) starts a SuperLink on the server machine, submits the
run with ``flwr run`` and waits for it: the ServerApp runs the fedfm engine there and writes
the run folder. ``fedfm client`` (:func:`client_main`) starts one SuperNode per client on
the client machines, each with its own partition (node config ``partition-id``).

By default a SuperNode runs in Flower's ``process`` isolation with a fedfm *warm worker*
(:mod:`fedfm.runtime.flower_app.worker`) next to it: one long-lived process that takes the
SuperNode's ClientApp tasks one after another, so torch, the task and the models are loaded
once per node rather than once per message (Flower's ``subprocess`` isolation starts a
``flwr-clientapp`` process for every message, about 2 s and a torch import each; it stays
available as ``isolation="subprocess"``).

Every process started here runs in its own process group and is stopped with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fedfm.errors import ConfigError, FedfmError
from fedfm.runtime.flower import (
    PAYLOAD_KEY,
    FlowerOptions,
    Payload,
    flower_env_vars,
    import_plugins,
    run_options,
)

if TYPE_CHECKING:
    from fedfm.config import RunConfig

log = logging.getLogger("fedfm")

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


class DeployError(FedfmError):
    """A Flower process failed to start or a run failed on the deployment engine."""


# --------------------------------------------------------------------------- files


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


def make_certificates(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """Creates a CA and a SuperLink certificate for ``hosts`` (IP addresses or DNS names).

    For tests and private deployments; a deployment with a real CA uses its files instead.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fedfm test CA"))
        .issuer_name(name("fedfm test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
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
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Creates a SuperNode's EC key pair for node authentication.

    Returns:
        ``(private_key_pem, public_key_openssh)``: the SuperNode keeps the first, the
        SuperLink's operator registers the second with ``flwr supernode register``.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv = folder / f"{name}.key"
    pub = folder / f"{name}.pub"
    # OpenSSH formats, as `ssh-keygen -t ecdsa -b 384` writes them: what Flower parses.
    priv.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    priv.chmod(0o600)
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return priv, pub


# --------------------------------------------------------------------------- commands


def _bin(name: str) -> str:
    # The Flower commands of this interpreter's environment, found even when it is not on PATH.
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    cmd = [_bin("flower-superlink"), "--host", host, "--port", str(port)]
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
    cmd = [_bin("flower-supernode"), "--superlink", superlink, "--node-config", node_config]
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


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A started process (in its own process group) and its log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def process_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Flower process started by fedfm."""
    env = dict(os.environ)
    env.update(flower_env_vars(home))
    # Flower starts its helpers (flower-superexec, flwr-serverapp) by name from PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: the child gets SIGTERM when the thread that started it ends, so a `fedfm
    # serve` or `fedfm client` killed with SIGKILL leaves no SuperLink or SuperNode behind.
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start(
    name: str,
    cmd: Sequence[str],
    env: Mapping[str, str],
    log_dir: Path,
    die_with_parent: bool = False,
) -> Proc:
    """Starts ``cmd`` in a new process group, output to ``log_dir/<name>.log``.

    Args:
        name: Name of the process (and of its log file).
        cmd: Command line.
        env: Environment.
        log_dir: Folder of the log file.
        die_with_parent: On Linux, end the process when the calling thread ends (for
            long-running commands started from the main thread).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.log"
    hook = _die_with_parent if die_with_parent and sys.platform == "linux" else None
    with path.open("wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=hook,
        )
    return Proc(name, popen, path)


def stop(procs: Iterable[Proc], grace_s: float = 5.0) -> None:
    """Stops processes and everything they started (SIGTERM to the group, then SIGKILL)."""
    procs = list(procs)
    for p in procs:
        _signal_group(p.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        # Children may outlive a leader that exited; the group id stays valid until they go.
        _signal_group(p.popen, signal.SIGKILL)
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("process %s (pid %d) did not stop", p.name, p.popen.pid)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def wait_port(host: str, port: int, timeout_s: float, proc: Proc | None = None) -> None:
    """Waits until something listens on ``host:port``.

    Raises:
        DeployError: Timeout, or ``proc`` exited first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise DeployError(f"{proc.name} exited (code {proc.popen.returncode}):\n{proc.tail()}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise DeployError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


def run_flwr(
    args: Sequence[str],
    env: Mapping[str, str],
    timeout_s: float | None,
    cwd: Path,
    echo: bool = False,
) -> str:
    """Runs a ``flwr`` CLI command and returns its output (also printed when ``echo``).

    Raises:
        DeployError: It failed or timed out (its process group is killed).
    """
    popen = subprocess.Popen(
        [_bin("flwr"), *args],
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=_pump, args=(popen, lines, echo), daemon=True)
    reader.start()
    try:
        popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(popen, signal.SIGKILL)
        popen.wait()
        reader.join(5)
        out = "".join(lines)[-3000:]
        raise DeployError(f"`flwr {args[0]}` timed out after {timeout_s:.0f} s:\n{out}") from None
    finally:
        _signal_group(popen, signal.SIGKILL)
    reader.join(5)
    out = "".join(lines)
    if popen.returncode != 0:
        cmd = " ".join(args[:2])
        raise DeployError(f"`flwr {cmd}` failed ({popen.returncode}):\n{out[-3000:]}")
    return out


def _pump(popen: subprocess.Popen, lines: list[str], echo: bool) -> None:
    assert popen.stdout is not None
    for line in popen.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def plugin_pythonpath(imports: Sequence[str]) -> list[str]:
    """Folders that make the plugin modules importable in child processes."""
    import importlib.util

    dirs: list[str] = []
    for name in imports:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        # A package lives in <root>/<name>/__init__.py, a module in <root>/<name>.py.
        root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
        if str(root) not in dirs:
            dirs.append(str(root))
    return dirs


def _with_pythonpath(env: dict[str, str], dirs: Sequence[str]) -> dict[str, str]:
    if dirs:
        parts = [*dirs, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


# --------------------------------------------------------------------------- server side


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

    Returns:
        The run summary.

    Raises:
        DeployError: A process failed, or the run ended without a summary.
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
    env_extra = _with_pythonpath({}, plugin_pythonpath(opts.imports))
    with tempfile.TemporaryDirectory(prefix="fedfm-serve-") as tmp:
        work = work_dir or Path(tmp)
        home = work / "flwr-home"
        link = start_superlink(
            home, work / "logs", host, port, tls, bool(node_keys), env_extra, die_with_parent=True
        )
        try:
            address = f"{_connect_host(host)}:{port}"
            write_connection(home, address, tls.ca_cert if tls else None)
            if node_keys:
                register_nodes(home, node_keys, work, env_extra)
            out = submit(home, work, payload, timeout_s, echo, env_extra)
        finally:
            stop([link])
        summary = run_dir / "summary.json"
        if not summary.exists():
            raise DeployError(f"the run ended without a summary ({summary}):\n{out[-3000:]}")
        return json.loads(summary.read_text())


# --------------------------------------------------------------------------- client side


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
) -> int:
    """Runs one client's SuperNode until interrupted (``fedfm client``).

    A SuperNode that exits (the SuperLink is not up yet, its key is not registered yet,
    a network failure) is started again after a growing pause, like a service manager
    would; with ``restart=False`` the first exit ends the command.

    Returns:
        The SuperNode's last exit code (0 after Ctrl-C).
    """
    with tempfile.TemporaryDirectory(prefix="fedfm-client-") as tmp:
        work = work_dir or Path(tmp)
        logs = work / "logs"
        state = state_dir or Path("fedfm-client-states") / str(partition_id)
        pause, code = 2.0, 0
        print(f"client {partition_id}: SuperNode for {superlink}; logs in {logs}", flush=True)
        try:
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
                    while all(p.alive() for p in procs):
                        time.sleep(1.0)
                finally:
                    stop(procs)
                code = int(procs[0].popen.returncode or 0)
                print(f"client {partition_id}: SuperNode exited ({code}):", file=sys.stderr)
                print(procs[0].tail(8), file=sys.stderr, flush=True)
                if not restart:
                    return code
                pause = 2.0 if time.monotonic() - started > 60 else min(pause * 2, 60.0)
                time.sleep(pause)
        except KeyboardInterrupt:
            return 0


# --------------------------------------------------------------------------- commands


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings (values parsed as YAML) as Flower options.

    Raises:
        ConfigError: A pair is not ``key=value``.
    """
    from fedfm.config import apply_override

    out: dict[str, Any] = {}
    for pair in pairs:
        apply_override(out, pair)
    return out


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


def serve_main(
    config: str,
    overrides: Sequence[str] = (),
    resume: bool = False,
    overwrite: bool = False,
    host: str = "0.0.0.0",
    port: int = 9092,
    certificates: Path | None = None,
    ssl_ca_certfile: Path | None = None,
    ssl_certfile: Path | None = None,
    ssl_keyfile: Path | None = None,
    insecure: bool = False,
    node_keys: Sequence[Path] = (),
    flower: Sequence[str] = (),
) -> dict[str, Any]:
    """``fedfm serve``: a run on the deployment engine, served from this machine.

    Args:
        config: Preset name or YAML file.
        overrides: ``key=value`` config overrides.
        resume: Continue the run from its last checkpoint.
        overwrite: Replace an existing run folder.
        host: Address the SuperLink listens on.
        port: Its port.
        certificates: Folder with ``ca.crt``, ``server.pem``, ``server.key``.
        ssl_ca_certfile: CA certificate (instead of ``certificates``).
        ssl_certfile: SuperLink certificate.
        ssl_keyfile: SuperLink private key.
        insecure: Run without TLS.
        node_keys: SuperNode public keys to accept (node authentication).
        flower: ``key=value`` Flower options (:class:`~fedfm.runtime.flower.FlowerOptions`).

    Returns:
        The run summary.
    """
    from fedfm.config import load_run_config

    cfg = load_run_config(config, [*overrides, "runtime=flower"], resume)
    tls = tls_files(certificates, ssl_ca_certfile, ssl_certfile, ssl_keyfile, insecure)
    for key in node_keys:
        if not Path(key).exists():
            raise ConfigError("node-key", f"file not found: {key}")
    return serve(
        cfg,
        resume=resume,
        overwrite=overwrite,
        options=parse_options(flower),
        host=host,
        port=port,
        tls=tls,
        node_keys=[Path(k) for k in node_keys],
    )


def client_main(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    root_certificates: Path | None = None,
    insecure: bool = False,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    isolation: str = "process",
) -> int:
    """``fedfm client``: one client's SuperNode, until interrupted.

    Raises:
        ConfigError: Bad partition, or neither a CA certificate nor ``insecure``.
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError("partition-id", f"{partition_id} is not in 0..{num_partitions - 1}")
    if (root_certificates is None) == (not insecure):
        raise ConfigError(
            "tls", "give --root-certificates CA_FILE, or --insecure to connect without TLS"
        )
    for name, path in (("root-certificates", root_certificates), ("auth-key", auth_key)):
        if path is not None and not Path(path).exists():
            raise ConfigError(name, f"file not found: {path}")
    return client(
        superlink,
        partition_id,
        num_partitions,
        root_certificates,
        auth_key,
        state_dir,
        isolation,
    )


def certs_main(
    out: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), nodes: int = 0
) -> None:
    """``fedfm flower-certs``: a CA, a SuperLink certificate and SuperNode key pairs."""
    tls = make_certificates(out, hosts)
    print(f"CA {tls.ca_cert}, SuperLink certificate {tls.server_cert} and key {tls.server_key}")
    for i in range(nodes):
        priv, pub = make_node_key(out, f"node{i}")
        print(f"SuperNode {i}: private key {priv}, public key {pub}")


def app_main(
    out: Path,
    config: str,
    overrides: Sequence[str] = (),
    resume: bool = False,
    overwrite: bool = False,
    flower: Sequence[str] = (),
) -> tuple[Path, Path]:
    """``fedfm flower-app``: the app folder and run config for ``flwr run`` on any SuperLink.

    Returns:
        ``(app_folder, run_config_toml)``.
    """
    from fedfm.config import load_run_config

    cfg = load_run_config(config, [*overrides, "runtime=flower"], resume)
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    cfg = cfg.model_copy(update={"out_dir": str(run_dir.parent)})
    opts = run_options(cfg, parse_options(flower))
    payload = Payload(cfg.model_dump(mode="json"), opts.model_dump(), resume, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    return write_app(out / "app"), write_run_config(out / "run_config.toml", payload)


def add_commands(app: Any) -> None:
    """Adds ``serve``, ``client`` and ``flower-certs`` to the ``fedfm`` typer app."""

    # typer reads the annotations below from this module's globals: import it there.
    @app.command("serve")
    def serve_cmd(
        config: Annotated[str, typer.Argument(help="preset name or YAML file")],
        overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
        resume: Annotated[bool, typer.Option("--resume")] = False,
        overwrite: Annotated[bool, typer.Option("--overwrite")] = False,
        host: Annotated[str, typer.Option(help="address the SuperLink listens on")] = "0.0.0.0",
        port: Annotated[int, typer.Option(help="SuperLink port")] = 9092,
        certificates: Annotated[
            Path | None, typer.Option(help="folder with ca.crt, server.pem, server.key")
        ] = None,
        ssl_ca_certfile: Annotated[Path | None, typer.Option()] = None,
        ssl_certfile: Annotated[Path | None, typer.Option()] = None,
        ssl_keyfile: Annotated[Path | None, typer.Option()] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="no TLS")] = False,
        node_key: Annotated[
            list[Path] | None, typer.Option(help="SuperNode public key to accept (repeat)")
        ] = None,
        flower: Annotated[
            list[str] | None, typer.Option(help="Flower option key=value (repeat)")
        ] = None,
    ) -> None:
        """Serve a run on Flower's deployment engine (SuperLink here, `fedfm client` there)."""
        summary = serve_main(
            config,
            overrides or [],
            resume,
            overwrite,
            host,
            port,
            certificates,
            ssl_ca_certfile,
            ssl_certfile,
            ssl_keyfile,
            insecure,
            node_key or [],
            flower or [],
        )
        primary = summary["primary"]
        print(f"{summary['name']}: {primary}={summary['final'].get(primary)}")

    @app.command("client")
    def client_cmd(
        superlink: Annotated[str, typer.Option(help="SuperLink host:port")],
        partition_id: Annotated[int, typer.Option(help="index of this client")],
        num_partitions: Annotated[int, typer.Option(help="number of clients")],
        root_certificates: Annotated[Path | None, typer.Option(help="CA certificate")] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="no TLS")] = False,
        auth_key: Annotated[Path | None, typer.Option(help="node private key")] = None,
        state_dir: Annotated[Path | None, typer.Option(help="client-state folder")] = None,
        isolation: Annotated[str, typer.Option(help="process or subprocess")] = "process",
    ) -> None:
        """Run one client's SuperNode for `fedfm serve` (until Ctrl-C)."""
        raise typer.Exit(
            client_main(
                superlink,
                partition_id,
                num_partitions,
                root_certificates,
                insecure,
                auth_key,
                state_dir,
                isolation,
            )
        )

    @app.command("flower-app")
    def app_cmd(
        out: Annotated[Path, typer.Argument(help="output folder")],
        config: Annotated[str, typer.Argument(help="preset name or YAML file")],
        overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
        resume: Annotated[bool, typer.Option("--resume")] = False,
        overwrite: Annotated[bool, typer.Option("--overwrite")] = False,
        flower: Annotated[
            list[str] | None, typer.Option(help="Flower option key=value (repeat)")
        ] = None,
    ) -> None:
        """Write a Flower app + run config for `flwr run` on an existing SuperLink."""
        folder, run_config = app_main(out, config, overrides or [], resume, overwrite, flower or [])
        print(f"flwr run {folder} <connection> --run-config {run_config} --stream")

    @app.command("flower-certs")
    def certs_cmd(
        out: Annotated[Path, typer.Argument(help="output folder")],
        host: Annotated[list[str] | None, typer.Option(help="SuperLink host name or IP")] = None,
        nodes: Annotated[int, typer.Option(help="SuperNode key pairs to make")] = 0,
    ) -> None:
        """Make a CA, a SuperLink certificate and SuperNode keys (private deployments)."""
        certs_main(out, host or ["127.0.0.1", "localhost"], nodes)
