"""The Flower commands of ``fedfm``: ``serve``, ``client``, ``flower-app``, ``flower-certs``.

Each is a typer command function that :mod:`fedfm.cli` registers as it is. A command turns
its arguments into validated values (a run config, TLS files, Flower options, existing key
files) and calls the deployment engine (:mod:`fedfm.runtime.flower.deploy`,
:mod:`fedfm.runtime.flower.deploy_client`) with them.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from fedfm.config import apply_override, load_run_config
from fedfm.errors import ConfigError
from fedfm.runtime.flower import deploy, deploy_client
from fedfm.runtime.flower.options import run_options
from fedfm.runtime.flower.payload import Payload
from fedfm.runtime.flower.processes import Stopped
from fedfm.runtime.flower.startup import ServerWorker
from fedfm.runtime.flower.tls import (
    DEFAULT_DAYS,
    add_node_keys,
    certificate_expiry,
    check_expiry,
    check_private,
    make_key_folder,
    renew_certificates,
    tls_files,
)

Overrides = Annotated[list[str] | None, typer.Argument(help="key=value overrides")]
FlowerPairs = Annotated[list[str] | None, typer.Option(help="Flower option key=value (repeat)")]


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings (values parsed as YAML) as Flower options.

    Raises:
        ConfigError: A pair is not ``key=value``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        apply_override(out, pair)
    return out


def algo_keys(name: str) -> list[str] | None:
    """:func:`fedfm.algorithms.algo_keys`, imported only when a config is loaded."""
    from fedfm.algorithms import algo_keys as keys

    return keys(name)


def _existing(name: str, path: Path | None) -> Path | None:
    if path is not None and not Path(path).exists():
        raise ConfigError(name, f"file not found: {path}")
    return path


def _check_device(name: str) -> None:
    """Refuses a ``--device`` this machine cannot compute on (one line naming ``device``)."""
    from fedfm import devices

    try:
        devices.check(name)
    except ValueError as err:
        raise ConfigError("device", str(err)) from None


def serve(
    config: Annotated[str, typer.Argument(help="preset name or YAML file")],
    overrides: Overrides = None,
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
    flower: FlowerPairs = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress display")] = False,
) -> None:
    """Serve a run on Flower's deployment engine (SuperLink here, `fedfm client` there).

    Shows each round and the final table as `fedfm run` does. SIGTERM or Ctrl-C stops every
    process it started and says the round to resume from (exit 143 or 130).
    """
    # The ServerApp process imports Flower, torch and fedfm, then checks the config in full
    # (the algorithms' keys, stages and sections) while the SuperLink starts: this process
    # loads it without the algorithms (torch) for its run folder and Flower section.
    with ServerWorker.start() as server:
        overrides = [*(overrides or []), "runtime=flower"]
        cfg = load_run_config(config, overrides, resume)
        tls = tls_files(certificates, ssl_ca_certfile, ssl_certfile, ssl_keyfile, insecure)
        if tls is not None:
            folder = certificates is not None  # the option that named the files (for messages)
            check_expiry(tls.ca_cert, "certificates" if folder else "ssl-ca-certfile")
            check_expiry(tls.server_cert, "certificates" if folder else "ssl-certfile")
            check_private(tls.server_key, "the SuperLink's TLS key")
            # The certificate must cover the name serve reaches its own SuperLink by.
            deploy.own_host(host, tls, "certificates" if folder else "ssl-certfile")
        keys = [Path(k) for k in node_key or []]
        for key in keys:
            _existing("node-key", key)
        try:
            summary = deploy.serve(
                cfg,
                resume=resume,
                overwrite=overwrite,
                options=parse_options(flower or []),
                host=host,
                port=port,
                tls=tls,
                node_keys=keys,
                progress=not quiet,
                server=server,
                named=(config, overrides),
            )
        except Stopped as e:  # deploy.serve has stopped everything and said where it stopped
            raise typer.Exit(e.exit_code) from None
        from fedfm.progress import summary_line

        print(summary_line(summary, (Path(cfg.out_dir) / cfg.name).resolve()), flush=True)


def client(
    superlink: Annotated[str, typer.Option(help="SuperLink host:port")],
    partition_id: Annotated[int, typer.Option(help="index of this client")],
    num_partitions: Annotated[int, typer.Option(help="number of clients")],
    root_certificates: Annotated[Path | None, typer.Option(help="CA certificate")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="no TLS")] = False,
    auth_key: Annotated[Path | None, typer.Option(help="node private key")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="client-state folder")] = None,
    isolation: Annotated[str, typer.Option(help="process or subprocess")] = "process",
    device: Annotated[
        str | None,
        typer.Option(help="device this client computes on (auto, cpu, cuda, cuda:N, mps)"),
    ] = None,
    wait: Annotated[
        float,
        typer.Option(
            help="seconds to wait for the first session, or for a SuperLink that refuses this"
            " node's key, before giving up (exit 2); inf: no limit"
        ),
    ] = deploy_client.WAIT_S,
) -> None:
    """Run one client's SuperNode for `fedfm serve` (until Ctrl-C or SIGTERM).

    Says what happens in one line each: waiting for the server, connected, served round N,
    server session ended; waiting for the next. Exits with code 2 when retrying cannot help
    (a TLS mismatch: at once) or after --wait seconds without a session (the server is not
    up, or does not accept this node's key); once it has served a session it waits for the
    next one without limit. SIGTERM or Ctrl-C stops the SuperNode and its worker and exits
    143 or 130.
    """
    if not wait > 0:
        raise ConfigError("wait", f"must be more than 0 seconds (inf: no limit), got {wait:g}")
    if device is not None:
        _check_device(device)
    if not 0 <= partition_id < num_partitions:
        raise ConfigError("partition-id", f"{partition_id} is not in 0..{num_partitions - 1}")
    if (root_certificates is None) == (not insecure):
        raise ConfigError(
            "tls", "give --root-certificates CA_FILE, or --insecure to connect without TLS"
        )
    if insecure and auth_key is not None:
        # Flower's SuperNode exits at once on this pair; restarting it would loop forever.
        raise ConfigError(
            "auth-key",
            "node authentication needs TLS: give --root-certificates CA_FILE instead of --insecure",
        )
    if root_certificates is not None and _existing("root-certificates", root_certificates):
        check_expiry(root_certificates, "root-certificates")
    if auth_key is not None and _existing("auth-key", auth_key):
        check_private(auth_key, "the node's private key")
    state = state_dir or Path("fedfm-client-states") / str(partition_id)
    try:
        code = deploy_client.client(
            superlink,
            partition_id,
            num_partitions,
            root_certificates=_existing("root-certificates", root_certificates),
            auth_key=_existing("auth-key", auth_key),
            state_dir=state,
            isolation=isolation,
            wait_s=wait,
            device=device,
        )
    except Stopped as e:
        name = signal.Signals(e.signum).name
        # Only a folder that exists: an algorithm without client state writes no snapshots.
        kept = f", its state snapshots stay in {state}" if state.is_dir() else ""
        print(
            f"client {partition_id}: stopped by {name} (SuperNode and worker stopped); run the"
            f" same command to rejoin{kept}",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(e.exit_code) from None
    raise typer.Exit(code)


def flower_app(
    out: Annotated[Path, typer.Argument(help="output folder")],
    config: Annotated[str, typer.Argument(help="preset name or YAML file")],
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option("--resume")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite")] = False,
    flower: FlowerPairs = None,
) -> None:
    """Write a Flower app + run config for `flwr run` on an existing SuperLink."""
    cfg = load_run_config(config, [*(overrides or []), "runtime=flower"], resume, algo_keys)
    from fedfm.engine import with_stages  # the algorithms: torch, once the config is read

    cfg = with_stages(cfg)  # rounds from the algorithm's stages, before the config travels
    # The ServerApp runs wherever the SuperLink starts it: give it an absolute run folder.
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    cfg = cfg.model_copy(update={"out_dir": str(run_dir.parent)})
    opts = run_options(cfg, parse_options(flower or []))
    payload = Payload(cfg.model_dump(mode="json"), opts.model_dump(), resume, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    folder = deploy.write_app(out / "app")
    run_config = deploy.write_run_config(out / "run_config.toml", payload)
    print(f"flwr run {folder} <connection> --run-config {run_config} --stream")


def flower_certs(
    out: Annotated[Path, typer.Argument(help="output folder")],
    host: Annotated[list[str] | None, typer.Option(help="SuperLink host name or IP")] = None,
    nodes: Annotated[int, typer.Option(help="SuperNode key pairs to make")] = 0,
    add_nodes: Annotated[
        int | None,
        typer.Option(help="add this many SuperNode keys to OUT; CA and certificate unchanged"),
    ] = None,
    days: Annotated[
        int, typer.Option(help="validity of the CA and the SuperLink certificate")
    ] = DEFAULT_DAYS,
    renew: Annotated[
        bool,
        typer.Option(
            "--renew", help="new CA and SuperLink certificate in OUT (same hosts); node keys kept"
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="replace key material already in OUT")
    ] = False,
) -> None:
    """Make a CA, a SuperLink certificate and SuperNode keys (private deployments).

    Refuses to replace key material already in OUT unless --force is given; --add-nodes N
    adds node keys to an existing folder without touching its CA and certificate; --renew
    replaces the CA and the certificate before they expire and keeps the node keys (nothing
    to register again; every client needs the new ca.crt). Private keys are written with
    mode 600 in a folder of mode 700.
    """
    if nodes < 0:
        raise ConfigError("nodes", f"must be at least 0, got {nodes}")
    if days < 1:
        raise ConfigError("days", f"must be at least 1, got {days}")
    made: list[tuple[Path, Path]] = []
    tls = None
    if add_nodes is not None:
        if host or nodes or force or renew:
            raise ConfigError(
                "add-nodes", "adds node keys only: leave out --host, --nodes, --renew and --force"
            )
        made = add_node_keys(out, add_nodes)
    elif renew:
        if nodes or force:
            raise ConfigError(
                "renew", "renews the certificates only: leave out --nodes and --force"
            )
        tls = renew_certificates(out, host, days)
    else:
        tls, made = make_key_folder(out, host or ["127.0.0.1", "localhost"], nodes, force, days)
    if tls is not None:
        until = certificate_expiry(tls.server_cert).strftime("%Y-%m-%d %H:%M UTC")
        print(
            f"CA {tls.ca_cert}, SuperLink certificate {tls.server_cert} and key"
            f" {tls.server_key}: valid until {until} ({days} days)"
        )
    for priv, pub in made:
        print(f"SuperNode {priv.stem}: private key {priv}, public key {pub}")
    if renew:
        print(
            f"Copy the new {out / 'ca.crt'} to every client machine and restart its `fedfm"
            " client` with it; node keys are unchanged (nothing to register again)."
        )
        return
    print(
        f"Copy {out / 'ca.crt'} and one node<i>.key to client machine i; keep server.key and the"
        " node<i>.pub files on the server (server.key never leaves it)."
    )
