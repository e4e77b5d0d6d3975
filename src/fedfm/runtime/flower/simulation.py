"""Runs on Flower's simulation engine: a ServerApp thread, one ClientApp per virtual SuperNode."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedfm.config import RunConfig
from fedfm.engine import resolve
from fedfm.errors import FedfmError
from fedfm.runtime.flower.options import (
    FlowerOptions,
    flower_env,
    import_plugins,
    quiet_flower,
    run_options,
)
from fedfm.runtime.flower.wire import Payload
from fedfm.runtime.flower_app import make_client_app, make_server_app
from fedfm.tasks.base import TASKS


def run_flower_sim(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: FlowerOptions | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs an experiment on Flower's simulation engine (one virtual SuperNode per client).

    The ServerApp runs in a thread of this process and the ClientApps in Ray actors; the
    run folder is the same as on the embedded runtime.

    Args:
        cfg: Validated run config.
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show the progress display.
        options: Flower options (:class:`FlowerOptions`).

    Returns:
        The run summary.
    """
    opts = run_options(cfg, options)
    import_plugins(opts.imports)
    _, task_cfg = resolve(cfg)
    num_clients = len(TASKS.get(task_cfg.kind)(task_cfg, cfg).client_ids())
    # Absolute: Ray actors need not share this process's working directory.
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    state_dir = opts.state_dir or str(run_dir / "flower_client_states")
    payload = Payload(
        config=cfg.model_dump(mode="json"),
        options={**opts.model_dump(), "state_dir": state_dir},
        resume=resume,
        overwrite=overwrite,
        progress=progress,
    )
    sink: dict[str, Any] = {}
    cuda = cfg.torch_device().type == "cuda"
    backend = backend_config(opts, cuda)
    from flwr.simulation import run_simulation

    with flower_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_flower(opts.verbose)
        run_simulation(
            server_app=make_server_app(payload, sink),
            client_app=make_client_app(client_payload(payload) if cuda else payload),
            num_supernodes=num_clients,
            backend_config=backend,
            verbose_logging=opts.verbose,
        )
    if "error" in sink:
        raise sink["error"]
    if "summary" not in sink:
        raise FedfmError("the Flower simulation ended without running the ServerApp")
    return sink["summary"]


def backend_config(opts: FlowerOptions, cuda: bool) -> dict[str, Any]:
    """Ray's settings: each client actor's CPUs, and its share of a GPU when ``cuda``."""
    cpus = opts.sim_cpus or os.cpu_count() or 1
    return {
        "client_resources": {
            "num_cpus": opts.client_cpus,
            "num_gpus": opts.client_gpus if cuda else 0.0,
        },
        "init_args": {"num_cpus": cpus, "include_dashboard": False, "log_to_driver": opts.verbose},
    }


def client_payload(payload: Payload) -> Payload:
    """The payload the simulated clients of a CUDA run read: device ``cuda``.

    Ray gives each client actor its share of a GPU by setting ``CUDA_VISIBLE_DEVICES`` to the
    GPU it chose, which the actor then sees as ``cuda:0``; the run's own index (``cuda:1``)
    names a GPU of the server's process and may not exist inside the actor.
    """
    return dataclasses.replace(payload, config={**payload.config, "device": "cuda"})
