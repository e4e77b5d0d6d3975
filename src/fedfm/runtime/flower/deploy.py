"""Flower's deployment engine for fedfm: SuperLink, SuperNodes, runs across machines.

``fedfm serve`` (:func:`serve`) starts a SuperLink on the server machine, submits the run
with ``flwr run`` and waits for it: the ServerApp runs the fedfm engine there and writes the
run folder. ``fedfm client`` (:func:`fedfm.runtime.flower.deploy_client.client`) starts one
SuperNode per client on the client machines, each with its own partition (node config
``partition-id``).

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

from fedfm.config import RunConfig, load_config
from fedfm.errors import ConfigError
from fedfm.runtime.flower.options import FlowerOptions, run_options
from fedfm.runtime.flower.payload import PAYLOAD_KEY, SESSIONS_FILE, Payload
from fedfm.runtime.flower.processes import (
    DeployError,
    FlwrCall,
    Proc,
    Stopped,
    bin_path,
    plugin_pythonpath,
    process_env,
    start,
    stop,
    stop_on_signals,
    strip_ansi,
    wait_port,
    with_pythonpath,
)
from fedfm.runtime.flower.startup import ServerWorker, check_request, wait_run
from fedfm.runtime.flower.tls import LOOPBACK_HOSTS, TlsFiles, certificate_hosts, covers
from fedfm.runtime.flower.watch import RunWatch

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
    """Writes the TOML file passed to ``flwr run --run-config`` (it carries the payload).

    Whole or not at all (a ``flwr run`` started ahead may be waiting for it).
    """
    part = path.with_name(path.name + ".part")
    part.write_text(f'{PAYLOAD_KEY} = "{payload.encode()}"\n')
    part.replace(path)
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
        home: Flower's home folder (``FLWR_HOME``) of the process.
        log_dir: Folder of the SuperLink's log file.
        host: Address the SuperLink listens on.
        port: Its port (Fleet and Control APIs for SuperNodes and ``flwr``).
        tls: Certificates; None runs without TLS.
        node_auth: Accept only SuperNodes whose public key was registered.
        env_extra: Environment variables added to the process's (see :func:`process_env`).
        wait_s: How long to wait for it to listen; None: return at once (then call
            :func:`wait_superlink`).
        die_with_parent: On Linux, end the SuperLink when the calling thread ends.
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
    """The name by which ``fedfm serve`` reaches the SuperLink it started.

    It uses the name to register the node keys and submit the run: ``host`` itself, or for a
    SuperLink on every address (``0.0.0.0``) 127.0.0.1, localhost, or an address of this machine.
    With TLS it must be a name the SuperLink's certificate covers, since the connection checks it.

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
    """The SuperNode public keys in the form the SuperLink registers.

    The keys are OpenSSH EC keys, as ``fedfm flower-certs`` writes them, read before anything
    starts.

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
    """Flower's Control API client and what a registration request needs.

    About a second of imports: done while the SuperLink starts.
    """
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
    """Registers SuperNode public keys with the SuperLink at ``address`` (node authentication).

    All over one connection from this process: what ``flwr supernode register KEY`` does, without
    starting the ``flwr`` CLI (about 2 s) for every key.

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
    payload: Payload | None,
    env_extra: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    echo: bool | Callable[[str], None] = False,
    when_up: tuple[str, int, float] | None = None,
) -> FlwrCall:
    """Submits a fedfm run with ``flwr run --stream`` and returns at once.

    The run goes to the SuperLink of ``$FLWR_HOME/config.toml``; wait for it with
    :meth:`FlwrCall.wait`. With ``when_up`` the CLI starts now and submits once the SuperLink
    listens (see :class:`FlwrCall`). Without ``payload`` it submits once the run config is
    written too (:func:`write_run_config` to ``work / "run_config.toml"``; needs ``when_up``).
    """
    app = write_app(work / "app")
    run_config = work / "run_config.toml"
    if payload is not None:
        write_run_config(run_config, payload)
    env = process_env(home, env_extra)
    args = ["run", str(app), CONNECTION, "--run-config", str(run_config), "--stream"]
    after = None if payload is not None else run_config
    return FlwrCall(args, env, work, log_path, echo, when_up, after)


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
    """Copies this session's Flower logs (SuperLink, ``flwr run``) into the run folder.

    They go to ``run_dir/flower_logs/<start time>/``, when this session wrote the run folder.

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
    named: tuple[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Runs an experiment on the deployment engine: SuperLink here, SuperNodes elsewhere.

    Starts a SuperLink, registers ``node_keys`` when given (node authentication), submits
    the run and waits for it; the ServerApp writes the run folder on this machine. The
    SuperNodes (``fedfm client``) may start before or after: the server waits up to
    ``options.node_wait_s`` for them.

    The ServerApp process checks the config in full (the algorithms and tasks, with torch;
    :func:`fedfm.runtime.flower.startup.check_run`) while the SuperLink starts; a refused
    config stops the SuperLink again and raises, with nothing written.

    Args:
        cfg: Validated run config; with ``named``, the config loaded without the algorithms
            (its run folder and Flower section are used until the full check answers).
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
        named: ``(source, overrides)`` as ``fedfm serve`` was given them: the ServerApp
            process loads the config from them with the algorithms' keys and stages (and
            the run goes with that config); None: ``cfg`` is the run's config.

    Returns:
        The run summary.

    Raises:
        ConfigError: The config, an option or an argument is refused (one line).
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
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    env_extra = with_pythonpath({}, plugin_pythonpath(opts.imports))
    source, overrides = named or (None, ())
    config = None if named else cfg.model_dump(mode="json")
    request = check_request(source, overrides, resume, opts.model_dump(), config)
    # Only says where a run stopped before the check answered (then replaced).
    watch = RunWatch(cfg, run_dir, False, "", enabled=False)
    worker = server or ServerWorker.start()
    worker.check(request)
    try:
        with stop_on_signals(), tempfile.TemporaryDirectory(prefix="fedfm-serve-") as tmp:
            work = work_dir or Path(tmp)
            home = work / "flwr-home"
            logs = work / "logs"
            # The SuperLink starts at once, while the ServerApp process imports and checks.
            link = start_superlink(
                home, logs, host, port, tls, bool(node_keys), env_extra, None, True, "process"
            )
            finished = False
            running = [link]
            try:
                address = f"{own}:{port}"
                ca = tls.ca_cert if tls else None
                write_connection(home, address, ca)
                env = process_env(home, env_extra)
                # Started together: the SuperLink; the `flwr run` CLI, which submits once
                # the SuperLink listens and the run config is written; and the key
                # registration, ready to go then. The ServerApp waits for the SuperNodes.
                flwr_run = start_submit(
                    home, work, None, env_extra, logs / "flwr-run.log",
                    show_warnings if echo else False, (own, port, 60.0),
                )  # fmt: skip
                try:
                    if node_keys:
                        import_control_client()
                    try:
                        wait_superlink(link, host, port)
                        if node_keys:
                            register_nodes(address, ca, node_keys)
                    except DeployError:
                        worker.verdict()  # a refused config is said first
                        raise
                    checked = worker.verdict()
                    config = checked["config"] if named else config
                    assert config is not None
                    cfg = load_config(config)
                    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
                    # The ServerApp runs in another process: give it an absolute run folder.
                    payload = Payload(
                        config={**config, "out_dir": str(run_dir.parent)},
                        options=opts.model_dump(),
                        resume=resume,
                        overwrite=overwrite,
                        started_at=started,
                    )
                    write_run_config(work / "run_config.toml", payload)
                    watch = RunWatch(cfg, run_dir, resume, checked["primary"], enabled=progress)
                    if resume:
                        print(watch.resume_line(), file=sys.stderr, flush=True)
                    # The ServerApp process takes the run as soon as `flwr run` submits it.
                    running.append(
                        worker.go(address, ca, env, plugin_pythonpath(opts.imports), logs)
                    )
                    with watch:
                        out = wait_run(flwr_run, running[-1], timeout_s)
                    finished = True
                except BaseException:
                    flwr_run.kill()
                    raise
            finally:
                # A finished run, or one the ServerApp never had, leaves the SuperLink nothing
                # to keep: a short grace. A stopped run gives the ServerApp time to end its
                # round's writes.
                stop(running, grace_s=1.0 if finished or len(running) == 1 else 5.0)
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


def _print_absent(run_dir: Path) -> None:
    """Prints the clients that took no part in the session that just ended."""
    path = run_dir / SESSIONS_FILE
    if not path.exists():
        return
    absent = json.loads(path.read_text())["sessions"][-1].get("absent") or {}
    if absent:
        who = ", ".join(f"{c} ({why})" for c, why in absent.items())
        print(f"clients that took no part: {who}", file=sys.stderr, flush=True)


def refuse_deployment(cfg: RunConfig, *args: Any, **kw: Any) -> NoReturn:
    """The ``flower`` runtime as :func:`fedfm.runtime.run` sees it.

    It is never started implicitly, since the deployment engine needs machines and certificates.

    Raises:
        ConfigError: Always, naming the commands that run it.
    """
    raise ConfigError(
        "runtime",
        "'flower' runs across machines: start `fedfm serve` here and `fedfm client` on"
        " each client (docs/running-across-machines.md), or use runtime=flower-sim",
    )
