"""Options of the Flower runtime, plugin imports, and the environment of Flower processes."""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fedfm.config import RunConfig, validate_section
from fedfm.errors import ConfigError


class FlowerOptions(BaseModel):
    """Settings of the Flower runtime that are not part of the experiment.

    Attributes:
        timeout_s: How long the server waits for the replies of one exchange; a client that
            has not answered by then (e.g. its SuperNode died) is a failed client.
        node_wait_s: How long the server waits at the start for a SuperNode per client.
        poll_s: Longest sleep between two polls for replies (the wait starts at 10 ms and
            doubles up to this).
        imports: Modules every process imports before building the task and the algorithm
            (plugins that register tasks, algorithms or models).
        client_cpus: CPUs per simulated client (Ray actor); the machine's CPUs divided by
            this is the number of clients that run at once.
        client_gpus: Share of a GPU per simulated client (Ray's ``num_gpus``) when the run's
            device is CUDA: 0.25 runs four clients on each GPU at once. Default 1.0, one
            client per GPU at a time: each Ray actor is its own process and loads its own
            copy of the base, so sharing a GPU multiplies the base's memory. Ignored (0) when
            the run computes on the CPU.
        sim_cpus: CPUs Ray may use in simulation (default: all).
        state_dir: Where ClientApps keep their clients' state snapshots for resume, when the
            SuperNode's node config does not say (``state-dir``). Simulation defaults to
            ``<run folder>/flower_client_states``; deployment to
            ``~/.cache/fedfm/client-states``.
        verbose: Keep Flower's and Ray's INFO logs.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(600.0, gt=0)
    node_wait_s: float = Field(120.0, ge=0)
    poll_s: float = Field(0.2, gt=0)
    imports: list[str] = Field(default_factory=list)
    client_cpus: float = Field(1.0, gt=0)
    client_gpus: float = Field(1.0, gt=0, le=1)
    sim_cpus: int | None = Field(None, ge=1)
    state_dir: str | None = None
    verbose: bool = False


def load_options(options: FlowerOptions | Mapping[str, Any] | None) -> FlowerOptions:
    """Validates Flower options given as a model, a mapping or None (defaults).

    Raises:
        ConfigError: A bad value, naming the ``flower.<field>``.
    """
    if isinstance(options, FlowerOptions):
        return options
    opts = validate_section(FlowerOptions, dict(options or {}), "flower")
    assert isinstance(opts, FlowerOptions)
    return opts


def run_options(cfg: RunConfig, options: FlowerOptions | Mapping[str, Any] | None) -> FlowerOptions:
    """Flower options of a run.

    A ``flower`` section of the run config (if the config has one) overridden by ``options``.
    """
    if isinstance(options, FlowerOptions):
        return options
    section = getattr(cfg, "flower", None) or {}
    return load_options({**dict(section), **dict(options or {})})


def import_plugins(names: list[str]) -> None:
    """Imports plugin modules (they register tasks, algorithms or models on import).

    Raises:
        ConfigError: A module cannot be imported.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError("flower.imports", f"cannot import '{name}' ({e})") from None


@contextmanager
def flower_env(home: Path | None = None) -> Iterator[Path]:
    """Environment for Flower commands: no telemetry, no update check, a private home.

    Args:
        home: ``FLWR_HOME`` to use; a fresh temporary folder when None.
    """
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    with tempfile.TemporaryDirectory(prefix="fedfm-flwr-") as tmp:
        root = home or Path(tmp)
        os.environ.update(flower_env_vars(root))
        try:
            yield root
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_ENV_KEYS = (
    "FLWR_TELEMETRY_ENABLED",
    "FLWR_DISABLE_UPDATE_CHECK",
    "FLWR_HOME",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION",
    "PYTHONPATH",
    "RAY_DEDUP_LOGS",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
)


def flower_env_vars(home: Path) -> dict[str, str]:
    """Environment variables every Flower process of fedfm gets."""
    return {
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_HOME": str(home),
        # Flower would otherwise install the app's dependencies into a fresh environment.
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        # Flower's executors poll for new ServerApp/ClientApp tasks every second by default.
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
    }


def quiet_flower(verbose: bool) -> None:
    """Leaves only Flower's warnings and errors in the log unless ``verbose``."""
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
