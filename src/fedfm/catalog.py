"""What ``fedfm list`` shows, read from a manifest instead of the registries' modules.

The built-in algorithms, tasks, data sets, partitioners, models, encoders, server optimizers
and robust aggregators register themselves in modules that import torch, transformers or datasets
(seconds to import). ``fedfm list`` reads their names and descriptions from
``catalog.json`` (package data) instead, so it answers at once. The manifest is made from
the registries themselves by :func:`build`; ``tests/test_cli_start.py`` checks that it still
equals them, and ``python -m fedfm.catalog`` writes it again after a registration changed.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedfm.config import preset_names
from fedfm.registry import Registry

#: ``(title, the key=NAME that selects an entry)`` of each registry, in the order shown.
SECTIONS = (
    ("algorithms", "algorithm"),
    ("tasks", "task.kind"),
    ("datasets", "task.dataset"),
    ("partitioners", "partition.scheme"),
    ("models", "task.model"),
    ("encoders", "algo.teacher | algo.embedder | algo.feature_model"),
    ("server optimizers", "algo.server_opt.name"),
    ("robust aggregators", "algo.aggregator.name"),
)
SERVER_OPT_KEY = "algo.server_opt.name"
AGGREGATOR_KEY = "algo.aggregator.name"
MANIFEST = "catalog.json"

Catalog = dict[str, Any]


def manifest_path() -> Path:
    """The manifest shipped in the fedfm package."""
    return Path(str(resources.files("fedfm") / MANIFEST))


def load() -> Catalog:
    """The manifest (names, descriptions, who uses which option), without importing torch."""
    data: Catalog = json.loads(manifest_path().read_text(encoding="utf-8"))
    return data


def build() -> Catalog:
    """The manifest from the live registries (imports every built-in module: seconds)."""
    import fedfm.algorithms
    import fedfm.integrations
    import fedfm.tasks  # noqa: F401  (registering imports)
    from fedfm.algorithms.base import ALGORITHMS
    from fedfm.core.optim import SERVER_OPTIMIZERS
    from fedfm.core.robust import AGGREGATORS, AggregatorConfig
    from fedfm.data.partition import PARTITIONERS
    from fedfm.data.sources import SOURCES
    from fedfm.models.encoders import ENCODERS
    from fedfm.models.registry import load_builtin_models
    from fedfm.tasks.base import TASKS

    registries: list[Registry[Any]] = [ALGORITHMS, TASKS, SOURCES, PARTITIONERS]
    registries += [load_builtin_models(), ENCODERS, SERVER_OPTIMIZERS, AGGREGATORS]
    return {
        "registries": [
            {"title": title, "key": key, "rows": [list(row) for row in reg.describe()]}
            for (title, key), reg in zip(SECTIONS, registries, strict=True)
        ],
        "used_by": {
            field: _aggregating(ALGORITHMS, field) for field in ("server_opt", "aggregator")
        },
        "aggregator_options": [
            [f"algo.aggregator.{k}=", f.description or ""]
            for k, f in AggregatorConfig.model_fields.items()
            if k != "name"
        ],
        "recipe_options": _recipe_rows(),
    }


def _recipe_rows() -> list[list[str]]:
    """The device and the LLM recipe knobs (FlowerTune's), with the values each takes."""
    from typing import get_args

    from fedfm.config import BNB_OPTIMIZERS, LrSchedule, TrainConfig
    from fedfm.devices import DEVICE_NAMES

    optimizers = get_args(TrainConfig.model_fields["optimizer"].annotation)
    schedules = get_args(LrSchedule.model_fields["name"].annotation)
    return [
        ["device=", " | ".join(DEVICE_NAMES), "auto: CUDA when present, else the CPU"],
        ["train.optimizer=", " | ".join(optimizers), f"{', '.join(BNB_OPTIMIZERS)}: CUDA"],
        ["train.schedule.name=", " | ".join(schedules),
         "clients' local lr over rounds (cosine: FlowerTune's cosine_annealing)"],
        ["train.schedule.min_lr=", "number <= train.lr", "where cosine ends"],
        ["train.schedule.warmup_rounds=", "integer < rounds", "linear warm-up to train.lr"],
        ["task.lora.target_modules=", "\\[names] | auto | all-linear",
         "auto: peft's default attention projections of the architecture"],
        ["task.lora.use_dora=", "true | false", "DoRA: magnitude + direction (peft)"],
        ["task.quantization=", "4bit | 8bit", "QLoRA NF4 / LLM.int8 base: CUDA"],
    ]  # fmt: skip


def _aggregating(algorithms: Registry[Any], field: str) -> list[str]:
    """Algorithms that aggregate client tensors and whose config has ``field``."""
    out = []
    for name in algorithms:
        algo = algorithms.get(name)
        sends = any(kind.up_arrays for kind in algo.messages)
        if sends and field in algo.Config.model_fields:
            out.append(name)
    return out


def render(data: Catalog, out: Console) -> None:
    """Prints the catalogue as ``fedfm list`` does.

    One table per registry with the key that selects from it, who uses the server optimizers and
    aggregators, and the presets.
    """
    for section in data["registries"]:
        table = Table(
            title=f"{section['title']}: {section['key']}=NAME",
            show_edge=False,
            title_justify="left",
        )
        table.add_column("name")
        table.add_column("description")
        for name, help_ in section["rows"]:
            table.add_row(name, help_)
        out.print(table)
        # One line however many algorithms there are (soft_wrap: no hard line breaks).
        if section["key"] == SERVER_OPT_KEY:
            out.print(f"used by: {', '.join(data['used_by']['server_opt'])}\n", soft_wrap=True)
        if section["key"] == AGGREGATOR_KEY:
            out.print(f"used by: {', '.join(data['used_by']['aggregator'])}", soft_wrap=True)
            opts = Table(title="aggregator options", show_edge=False, title_justify="left")
            opts.add_column("key=VALUE")
            opts.add_column("meaning")
            for key, meaning in data["aggregator_options"]:
                opts.add_row(key, meaning)
            out.print(opts)
    out.print(_recipe_table(data["recipe_options"]))
    out.print("[bold]presets[/]: " + ", ".join(preset_names()))


def _recipe_table(rows: list[list[str]]) -> Table:
    import importlib.util

    bnb = "installed" if importlib.util.find_spec("bitsandbytes") else "not installed"
    table = Table(
        title=f"devices and LLM recipe options (bitsandbytes {bnb})",
        show_edge=False,
        title_justify="left",
    )
    table.add_column("key=VALUE", no_wrap=True)
    table.add_column("values")
    table.add_column("meaning")
    for row in rows:
        table.add_row(*row)
    return table


def dumps(data: Catalog) -> str:
    """The manifest as JSON with one entry per line (readable diffs when a registry changes)."""

    def one(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    def rows(items: list[Any], indent: str) -> str:
        return ",\n".join(indent + one(x) for x in items)

    sections = ",\n".join(
        f'  {{"title": {one(s["title"])}, "key": {one(s["key"])}, "rows": [\n'
        f"{rows(s['rows'], '   ')}\n  ]}}"
        for s in data["registries"]
    )
    return (
        f'{{\n "registries": [\n{sections}\n ],\n "used_by": {one(data["used_by"])},\n'
        f' "aggregator_options": [\n{rows(data["aggregator_options"], "  ")}\n ],\n'
        f' "recipe_options": [\n{rows(data["recipe_options"], "  ")}\n ]\n}}\n'
    )


def main() -> None:
    """``python -m fedfm.catalog [PATH]``: writes the manifest (default: the package's)."""
    args = sys.argv[1:]
    if len(args) > 1 or (args and args[0].startswith("-")):
        sys.exit("usage: python -m fedfm.catalog [PATH]")
    path = Path(args[0]) if args else manifest_path()
    path.write_text(dumps(build()), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
