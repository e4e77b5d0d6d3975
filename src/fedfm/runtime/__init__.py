"""Runtimes: where the clients of a run live, and the one entry point that runs a config.

A runtime is a function ``(cfg, resume, overwrite, progress, options) -> summary`` registered
in :data:`RUNTIMES` under the name a run config's ``runtime`` field takes. Each builds the
engine (:class:`fedfm.engine.Engine`) with its own federation factory; the engine never
imports a runtime. :func:`run` picks the runtime from the registry.

The built-in runtimes are registered by module path and imported when first run, so that
importing this package (as the ``fedfm`` command does) stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from fedfm.config import RunConfig, load_config
from fedfm.registry import Registry


class Runtime(Protocol):
    """Runs one experiment and returns its summary (what ``summary.json`` holds).

    Args:
        cfg: Validated run config.
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show the progress display.
        options: Runtime options (the Flower options of the Flower runtimes).
    """

    def __call__(
        self,
        cfg: RunConfig,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Runs the experiment ``cfg`` and returns its summary."""
        ...


RUNTIMES: Registry[Runtime] = Registry("runtime", "runtime")


def _lazy(module: str, name: str) -> Runtime:
    """A runtime that imports ``module`` and calls its ``name`` when first run."""

    def runtime(cfg: RunConfig, *args: Any, **kw: Any) -> dict[str, Any]:
        return getattr(importlib.import_module(module), name)(cfg, *args, **kw)

    return runtime


RUNTIMES.register("embedded", "every client in this process (default)")(
    _lazy("fedfm.runtime.embedded", "run_embedded")
)
RUNTIMES.register("flower-sim", "Flower's simulation engine in this process")(
    _lazy("fedfm.runtime.flower.simulation", "run_flower_sim")
)
RUNTIMES.register("flower", "Flower's deployment engine: `fedfm serve` + `fedfm client`")(
    _lazy("fedfm.runtime.flower.deploy", "refuse_deployment")
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
    if not isinstance(source, RunConfig):
        from fedfm.algorithms import algo_keys  # an algorithm= override drops foreign keys

        source = load_config(source, overrides, algo_keys)
    from fedfm.engine import with_stages

    # Rounds from the algorithm's stages before any runtime dumps the config for another
    # process (a dumped config gives every field, rounds included).
    source = with_stages(source)
    return RUNTIMES.get(source.runtime)(source, resume, overwrite, progress, options)
