"""Runtimes: where the clients of a run live, and the one entry point that runs a config.

A runtime is a function ``(cfg, resume, overwrite, progress, options) -> summary`` registered
in :data:`RUNTIMES` under the name a run config's ``runtime`` field takes. Each builds the
engine (:class:`fedfm.engine.Engine`) with its own federation factory; the engine never
imports a runtime. :func:`run` picks the runtime from the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fedfm.config import RunConfig, load_config
from fedfm.registry import Registry
from fedfm.runtime.embedded import run_embedded
from fedfm.runtime.flower import refuse_deployment, run_flower_sim


class Runtime(Protocol):
    """Runs one experiment and returns its summary (``summary.json``)."""

    def __call__(
        self,
        cfg: RunConfig,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]: ...


RUNTIMES: Registry[Runtime] = Registry("runtime", "runtime")
RUNTIMES.register("embedded", "every client in this process (default)")(run_embedded)
RUNTIMES.register("flower-sim", "Flower's simulation engine in this process")(run_flower_sim)
RUNTIMES.register("flower", "Flower's deployment engine: `fedfm serve` + `fedfm client`")(
    refuse_deployment
)


def run(
    source: str | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs a config on the runtime its ``runtime`` field names.

    Args:
        source: A validated config, a preset name, a YAML path or a mapping.
        overrides: ``key=value`` overrides (for a source that is not a validated config).
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show the progress display.
        options: Runtime options (the Flower options of the Flower runtimes).

    Returns:
        The run summary.

    Raises:
        ConfigError: A bad config, or a runtime that cannot run from here.
    """
    cfg = source if isinstance(source, RunConfig) else load_config(source, overrides)
    return RUNTIMES.get(cfg.runtime)(cfg, resume, overwrite, progress, options)
