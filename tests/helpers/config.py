"""One config builder for every test: a base, the run folder and the changes of one test."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

import helpers.toy  # noqa: F401  (registers the toy task that toy_config names)

# Tiny random Llama-family bases (``model_args`` of the ``tiny-*`` models): seconds per run.
TINY_LLAMA: dict[str, Any] = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 0}

# The toy regression task (``helpers.toy``) under FedAvg: the runtime and engine tests' base.
TOY: dict[str, Any] = {
    "algorithm": "fedavg",
    "rounds": 3,
    "seed": 3,
    "task": {"kind": "toy", "num_clients": 4},
    "plots": False,
    "train": {"steps": 3, "batch_size": 8, "lr": 0.05},
}


def tiny_llama_args(**changes: Any) -> dict[str, Any]:
    """``model_args`` of a tiny random Llama, with ``changes`` (e.g. ``seed=8, layers=1``)."""
    return {**TINY_LLAMA, **changes}


def make_config(base: Mapping[str, Any], out: Path | str | None = None, /, **changes: Any) -> dict:
    """A config dict: a deep copy of ``base`` with ``out_dir`` set to ``out`` and ``changes``.

    A change whose value is a dict merges into the section it names (one level, as a test
    writes ``train={"lr": 1.0}`` to change only the rate); ``a__b=v`` sets ``cfg["a"]["b"]``
    at any depth; any other value replaces the key.
    """
    cfg = copy.deepcopy(dict(base))
    if out is not None:
        cfg["out_dir"] = str(out)
    for key, value in changes.items():
        *path, last = key.split("__")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        old = node.get(last)
        if isinstance(value, Mapping) and isinstance(old, Mapping) and not path:
            node[last] = {**old, **copy.deepcopy(dict(value))}
        else:
            node[last] = copy.deepcopy(value)
    return cfg


def toy_config(out: Path | str, algorithm: str = "fedavg", /, **changes: Any) -> dict[str, Any]:
    """The toy-task config of ``algorithm`` (named after it unless ``name`` is given);
    ``num_clients`` sets the task's client count."""
    clients = changes.pop("num_clients", None)
    changes = {"name": algorithm, **changes}
    cfg = make_config(TOY, out, algorithm=algorithm, **changes)
    if clients is not None:
        cfg["task"]["num_clients"] = clients
    return cfg


def write_yaml(folder: Path, cfg: Mapping[str, Any], name: str | None = None) -> Path:
    """Writes ``cfg`` to ``folder/<name>.yaml`` (``name`` defaults to the config's name)."""
    path = folder / f"{name or cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(dict(cfg)))
    return path


def toy_yaml(folder: Path, name: str = "c", **changes: Any) -> Path:
    """A two-round toy FedAvg config (seed 1, at least two clients) written as
    ``folder/<name>.yaml``, running into ``folder/runs``; the command-line tests' input."""
    cfg = toy_config(
        folder / "runs", "fedavg", name=name, rounds=2, seed=1, clients={"min_clients": 2}
    )
    return write_yaml(folder, make_config(cfg, None, **changes), name)
