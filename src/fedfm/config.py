"""Run configuration: pydantic models, YAML presets and ``key=value`` overrides.

Every value is validated when the config is loaded (DESIGN.md principle 8). The algorithm
and the task each validate their own section (``algo``, ``task``) with their own models,
so a bad value anywhere gives one line naming the dotted field and the reason.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import re
from collections.abc import Callable, Collection
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fedfm import devices

# The sections the core owns, re-exported: configs are imported from here.
from fedfm.core.settings import (
    BNB_OPTIMIZERS,
    CommConfig,
    SecAggConfig,
    Strict,
    TrainConfig,
    UserLevelConfig,
)
from fedfm.core.settings import AdaptiveClipConfig as AdaptiveClipConfig
from fedfm.core.settings import LrSchedule as LrSchedule
from fedfm.errors import ConfigError

log = logging.getLogger("fedfm")


class ClientsConfig(Strict):
    """Client sampling and roles."""

    fraction: float = Field(1.0, gt=0, le=1)
    min_clients: int = Field(1, ge=1)
    roles: dict[str, float | list[int | str]] = Field(
        default_factory=dict,
        description="role -> fraction of the clients (seeded) or a list of client ids",
    )
    parallel: int | Literal["auto"] = Field(
        1,
        description="clients trained at once in worker processes on the embedded runtime:"
        " N, or auto (from the cores and the memory plan); 1 runs them one after the other",
    )

    @field_validator("parallel")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be auto or a number of worker processes >= 1")
        return v

    @field_validator("roles")
    @classmethod
    def _roles_sum(cls, v: dict[str, float | list[int | str]]) -> dict[str, float | list[str]]:
        fractions = [f for f in v.values() if isinstance(f, float | int)]
        if any(f < 0 or f > 1 for f in fractions):
            raise ValueError("each role fraction must lie in [0, 1]")
        if sum(fractions) > 1 + 1e-9:
            raise ValueError("role fractions sum to more than 1")
        # Client ids are strings; YAML reads [0, 3] as integers.
        return {r: f if isinstance(f, float | int) else [str(c) for c in f] for r, f in v.items()}


class PrivacyConfig(Strict):
    """How the run's privacy ledger reports (see :mod:`fedfm.core.privacy`).

    Attributes:
        delta: The run's δ: every ε is reported at it, and DP-SGD calibrates to it unless its
            own ``delta`` is set. Must be below ``1/n`` for a client with ``n`` records.
        accountant: ``rdp`` (Rényi DP at Opacus's orders) or ``pld`` (privacy loss
            distributions, tighter and slower).
        noise: Where a DP mechanism's noise comes from: ``secret`` (default), a secret each
            client draws from OS entropy and keeps in its state (the server cannot
            regenerate the noise); ``seeded``, from the run seed, so that two runs draw the
            same noise (exact re-runs in simulation; no guarantee against anyone who knows
            the seed).
        user_level: Client-level DP-FedAvg of the aggregated tensors; None: off.
        secure_aggregation: ``secagg+``: the server learns only the sum of the clients'
            updates (SecAgg+, :mod:`fedfm.core.secagg`); ``none``: it sees each update.
        secagg: SecAgg+'s parameters.
    """

    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = "rdp"
    noise: Literal["secret", "seeded"] = "secret"
    user_level: UserLevelConfig | None = None
    secure_aggregation: Literal["none", "secagg+"] = "none"
    secagg: SecAggConfig = Field(default_factory=SecAggConfig)


class LogConfig(Strict):
    """What a run writes besides its JSON logs.

    Attributes:
        html: Write ``report.html`` (a self-contained page, :mod:`fedfm.html_report`) at the
            end of the run (with the other figures: not when ``plots`` is false).
        tensorboard: Also log each round's metrics and bytes for TensorBoard into
            ``tensorboard/`` (needs the ``tensorboard`` package: ``pip install
            'fedfm[tensorboard]'``).
    """

    html: bool = True
    tensorboard: bool = False

    @field_validator("tensorboard")
    @classmethod
    def _installed(cls, v: bool) -> bool:
        if v and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("needs the tensorboard package: pip install 'fedfm[tensorboard]'")
        return v


class RunConfig(Strict):
    """One experiment."""

    name: str = Field("run", description="the run folder's name: one plain path component")
    seed: int = Field(0, ge=0)
    rounds: int = Field(10, ge=0)
    algorithm: str = "fedavg"
    algo: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=lambda: {"kind": "tabular"})
    partition: dict[str, Any] = Field(default_factory=dict)
    clients: ClientsConfig = Field(default_factory=ClientsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    runtime: Literal["embedded", "flower-sim", "flower"] = "embedded"
    flower: dict[str, Any] = Field(default_factory=dict)  # Flower runtime options
    eval_every: int = Field(1, ge=1)
    eval_before: bool = True
    out_dir: str = "runs"
    threads: int | None = Field(None, ge=1)
    device: str = Field(
        "auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps"
    )
    plots: bool = True
    log: LogConfig = Field(default_factory=LogConfig)

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        return devices.check(v)

    @model_validator(mode="after")
    def _fits_the_run(self) -> RunConfig:
        warmup = self.train.schedule.warmup_rounds
        if warmup and warmup >= self.rounds:
            raise ConfigError(
                "train.schedule.warmup_rounds",
                f"{warmup} warm-up rounds leave none of the run's {self.rounds} rounds",
            )
        if self.clients.parallel not in (1, "auto"):
            why = devices.fork_refused(self.torch_device())
            if self.runtime != "embedded":
                why = f"worker processes are the embedded runtime's; {self.runtime} has its own"
            if why:
                raise ConfigError("clients.parallel", why)
        if self.train.optimizer in BNB_OPTIMIZERS and self.torch_device().type != "cuda":
            raise ConfigError(
                "train.optimizer",
                f"{self.train.optimizer} needs a CUDA device; device {self.device!r} is"
                f" {self.torch_device()} here",
            )
        return self

    def torch_device(self) -> Any:
        """The ``torch.device`` that ``device`` resolves to on this machine."""
        return devices.resolve(self.device)

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, v: str) -> str:
        # The run folder is out_dir/name: a name that climbs, nests or hides would put the
        # run (and --overwrite) somewhere the user did not mean.
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", v):
            raise ValueError(
                "must be one plain folder name: letters, digits, '.', '_' or '-',"
                " not starting with '.'"
            )
        return v


def preset_dir() -> Path:
    """Folder of the presets shipped with fedfm."""
    return Path(str(resources.files("fedfm") / "presets"))


def preset_names() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def _load_yaml(source: str) -> dict[str, Any]:
    path = Path(source)
    if not path.suffix:
        candidate = preset_dir() / f"{source}.yaml"
        if not candidate.exists():
            raise ConfigError(
                "preset", f"unknown preset '{source}' (choose from {', '.join(preset_names())})"
            )
        path = candidate
    if not path.exists():
        raise ConfigError("config", f"file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML ({str(e).splitlines()[0]})") from e
    if data is None:
        raise ConfigError("config", f"{path} is empty")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping, got {type(data).__name__}")
    return data


_OVERRIDE = re.compile(r"^([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*)=(.*)$", re.S)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Applies one ``a.b.c=value`` override in place; the value is parsed as YAML.

    Raises:
        ConfigError: The override is not of the form ``key=value``.
    """
    m = _OVERRIDE.match(override)
    if not m:
        raise ConfigError("override", f"'{override}' is not of the form key=value")
    keys, raw = m.group(1).split("."), m.group(2)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(keys[: i + 1]), "is not a section, cannot set a sub-key")
        node = nxt
    node[keys[-1]] = value


def config_error(err: ValidationError, prefix: str = "") -> ConfigError:
    """Turns the first pydantic error into a one-line ConfigError with a dotted field."""
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "config")
    if e["type"] == "extra_forbidden":
        return ConfigError(field, "unknown key")
    if e["type"] == "missing":
        return ConfigError(field, "required value is missing")
    got = e.get("input")
    got_s = "" if isinstance(got, dict) else f" (got {got!r})"
    msg = e["msg"]
    # A validator's own reason reads as written; pydantic's own messages in lower case.
    msg = msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg.lower()
    return ConfigError(field, f"{msg}{got_s}")


Section = TypeVar("Section", bound=BaseModel)


def validate_section(model: type[Section], data: dict[str, Any], prefix: str) -> Section:
    """Validates a sub-section (``algo``, ``task``, ``partition``) with its own model."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise config_error(e, prefix) from None


def check_finite(data: Any, path: str = "") -> None:
    """Refuses NaN and infinite numbers anywhere in a config, free-form sections included.

    Raises:
        ConfigError: Naming the dotted path of the first non-finite value.
    """
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(path or "config", f"must be a finite number (got {data})")
    if isinstance(data, dict):
        for k, v in data.items():
            check_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(data, list | tuple):
        for i, v in enumerate(data):
            check_finite(v, f"{path}.{i}")


def _override_keys(overrides: list[str]) -> set[str]:
    return {m.group(1) for ov in overrides if (m := _OVERRIDE.match(ov))}


AlgoKeys = Callable[[str], Collection[str] | None]
"""Keys of the ``algo`` section an algorithm takes, None for an unknown algorithm
(:func:`fedfm.algorithms.algo_keys`)."""


def drop_foreign_algo_keys(data: dict[str, Any], explicit: set[str], algo_keys: AlgoKeys) -> None:
    """After ``algorithm=`` switched the algorithm, drops ``algo`` keys it does not take.

    A preset's ``algo`` section belongs to the preset's algorithm. Keys set on the command
    line (in ``explicit``) are kept, so a typo there is still an error. One notice names
    what was dropped and what the new algorithm accepts.

    Args:
        data: The raw config (changed in place).
        explicit: Keys set by overrides.
        algo_keys: The keys each algorithm's section takes.
    """
    algo, name = data.get("algo"), data.get("algorithm")
    fields = algo_keys(name) if isinstance(name, str) else None
    if not isinstance(algo, dict) or fields is None:
        return
    mine = {k.split(".")[1] for k in explicit if k.startswith("algo.") and k.count(".") >= 1}
    dropped = [k for k in algo if k not in fields and k not in mine]
    for k in dropped:
        del algo[k]
    if dropped:
        log.warning(
            "algorithm=%s: dropped %s from the config's algo section (%s takes %s)",
            name,
            ", ".join(f"algo.{k}" for k in dropped),
            name,
            ", ".join(fields) or "no options",
        )


def load_config(
    source: str | dict[str, Any],
    overrides: list[str] | None = None,
    algo_keys: AlgoKeys | None = None,
) -> RunConfig:
    """Loads a preset name, YAML path or dict, applies overrides and validates it.

    Args:
        source: Preset name (e.g. ``"quickstart"``), path to a YAML file, or a mapping.
        overrides: ``key=value`` strings with dotted keys.
        algo_keys: With it, an ``algorithm=`` override that switches the algorithm drops the
            ``algo`` keys the new one does not take (:func:`drop_foreign_algo_keys`).

    Returns:
        The validated run config. Sections owned by the algorithm and the task are checked
        by :func:`fedfm.engine.resolve` as well, so that all errors surface at load.

    Raises:
        ConfigError: Anything is wrong, with the field named.
    """
    data = copy.deepcopy(source) if isinstance(source, dict) else _load_yaml(source)
    before = data.get("algorithm", "fedavg")
    for ov in overrides or []:
        apply_override(data, ov)
    explicit = _override_keys(overrides or [])
    if algo_keys is not None and "algorithm" in explicit and data.get("algorithm") != before:
        drop_foreign_algo_keys(data, explicit, algo_keys)
    check_finite(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


def load_run_config(
    source: str | dict[str, Any],
    overrides: list[str] | None = None,
    resume: bool = False,
    algo_keys: AlgoKeys | None = None,
) -> RunConfig:
    """Loads a config to run; on resume, the run folder's saved config wins.

    A resumed run continues the experiment it started, so its saved ``config.yaml`` is used
    with ``overrides`` applied on top (e.g. more rounds); the config named on the command
    line only locates the run folder. A run folder without a saved config starts afresh
    from ``source``.

    Args:
        source: Preset name, YAML path or mapping.
        overrides: ``key=value`` strings.
        resume: Whether the run resumes.
        algo_keys: See :func:`load_config`.

    Raises:
        ConfigError: Anything is wrong, with the field named.
    """
    cfg = load_config(source, overrides, algo_keys)
    if resume:
        saved = Path(cfg.out_dir) / cfg.name / "config.yaml"
        if saved.exists():
            cfg = load_config(str(saved), overrides, algo_keys)
    return cfg
