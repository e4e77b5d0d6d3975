"""Instruction data from the Hugging Face hub or local files, mapped to fedfm's columns.

Two common formats are understood:

* Dolly-15k (``databricks/databricks-dolly-15k``): ``instruction``, ``context``, ``response``,
  ``category``;
* Alpaca (``tatsu-lab/alpaca`` and its many derivatives): ``instruction``, ``input``, ``output``.

Both become ``id``, ``instruction``, ``input``, ``output``, ``domain`` (Dolly's ``category``, else
``"general"``); other columns are dropped. Local ``.json``/``.jsonl``/``.parquet`` files, or a
folder of them, are read with ``datasets.load_dataset("json"|"parquet", data_files=...)``; any
other string is taken as a hub id. No hub dataset ships offline here: hub ids are for users on
machines with network access (the offline instruction sets are in :mod:`fedfm.data.sources`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import datasets
import numpy as np

from fedfm.data.sources import (
    LoadedSource,
    SourceInfo,
    register_source,
    source_info,
)
from fedfm.data.sources.instructions import instruction_dataset
from fedfm.errors import AssetMissingError, ConfigError

Format = Literal["auto", "alpaca", "dolly"]
_FORMATS: dict[str, tuple[set[str], dict[str, str]]] = {
    # format -> (required columns, rename map onto the standard columns)
    "dolly": (
        {"instruction", "context", "response"},
        {"instruction": "instruction", "context": "input", "response": "output"},
    ),
    "alpaca": (
        {"instruction", "output"},
        {"instruction": "instruction", "input": "input", "output": "output"},
    ),
}
_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
PATH_FIELD = "task.source_options.path"


def load_instruction_dataset(
    path_or_id: str, split: str = "train", fmt: Format = "auto"
) -> datasets.Dataset:
    """Loads Dolly- or Alpaca-format instruction data as standard instruction columns.

    Args:
        path_or_id: A local ``.json``/``.jsonl``/``.parquet`` file, a folder of such files, or a
            hub dataset id such as ``"databricks/databricks-dolly-15k"``.
        split: Split to load. A local file is one split whatever its name; in a folder, files
            whose name starts with ``split`` are used when any does, else (for ``"train"``) all.
        fmt: ``"dolly"``, ``"alpaca"`` or ``"auto"`` (detected from the columns).

    Returns:
        Columns ``id`` (int64; the data's own integer ``id`` when it has one, else the row
        position), ``instruction``, ``input``, ``output``, ``domain``.

    Raises:
        ConfigError: Missing file, unsupported file type, or columns matching no format.
        AssetMissingError: A hub id that cannot be loaded (e.g. offline).
    """
    raw = _load_raw(path_or_id, split)
    return to_instruction_columns(raw, fmt, source=path_or_id)


def _load_raw(path_or_id: str, split: str) -> datasets.Dataset:
    path = Path(path_or_id).expanduser()
    if path.exists():
        builder, files = _local_files(path, split)
        return datasets.load_dataset(builder, data_files={split: files}, split=split)
    if path.suffix in _SUFFIXES or path_or_id.startswith(("/", ".", "~")):
        raise ConfigError(PATH_FIELD, f"file not found: {path}")
    try:
        return datasets.load_dataset(path_or_id, split=split)
    except Exception as exc:  # network, auth, unknown id: one line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AssetMissingError(f"could not load hub dataset '{path_or_id}': {first}") from exc


def _local_files(path: Path, split: str) -> tuple[str, list[str]]:
    """Returns the ``datasets`` builder name and the data files for a local file or folder."""
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise ConfigError(
                PATH_FIELD, f"unsupported file type '{path.suffix}' (use .json, .jsonl, .parquet)"
            )
        return _SUFFIXES[path.suffix], [str(path)]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _SUFFIXES)
    chosen = [p for p in files if p.name.startswith(split)]
    if not chosen and split == "train":
        chosen = files
    if not chosen:
        raise ConfigError(
            PATH_FIELD, f"no .json/.jsonl/.parquet files for split '{split}' in {path}"
        )
    builders = {_SUFFIXES[p.suffix] for p in chosen}
    if len(builders) > 1:
        raise ConfigError(PATH_FIELD, f"{path} mixes json and parquet files; keep one kind")
    return builders.pop(), [str(p) for p in chosen]


def detect_format(columns: list[str]) -> str:
    """Returns ``"dolly"`` or ``"alpaca"`` from a column list.

    Raises:
        ConfigError: Neither format's required columns are present.
    """
    cols = set(columns)
    for name in ("dolly", "alpaca"):
        if _FORMATS[name][0] <= cols:
            return name
    raise ConfigError(
        "task.source_options.fmt",
        f"columns {sorted(cols)} match neither Dolly (instruction, context, response) "
        "nor Alpaca (instruction, input, output)",
    )


def to_instruction_columns(
    raw: datasets.Dataset, fmt: Format = "auto", source: str = "data"
) -> datasets.Dataset:
    """Maps a Dolly- or Alpaca-format dataset onto the standard instruction columns."""
    if fmt not in ("auto", "alpaca", "dolly"):
        raise ConfigError(
            "task.source_options.fmt", f"unknown format '{fmt}' (auto, alpaca, dolly)"
        )
    name = detect_format(raw.column_names) if fmt == "auto" else fmt
    required, rename = _FORMATS[name]
    missing = sorted(required - set(raw.column_names))
    if missing:
        raise ConfigError("task.source_options.fmt", f"{source}: {name} format needs {missing}")
    n = len(raw)

    def texts(col: str) -> list[str]:
        return (
            [str(v) if v is not None else "" for v in raw[col]]
            if col in raw.column_names
            else [""] * n
        )

    cols = {std: texts(src) for src, std in rename.items()}
    domain = texts("category") if "category" in raw.column_names else ["general"] * n
    cols["domain"] = [d or "general" for d in domain]
    ids = np.arange(n, dtype=np.int64)
    id_feature = raw.features.get("id")
    if isinstance(id_feature, datasets.Value) and id_feature.dtype.startswith(("int", "uint")):
        own = np.asarray(raw["id"], dtype=np.int64)
        if len(np.unique(own)) == n:  # duplicate ids would defeat overlap checks: use positions
            ids = own
    return instruction_dataset({"id": ids, **cols})


@register_source(
    SourceInfo(
        "hf",
        "instruction",
        "datasets==4.8.5 (user data: hub id or local file)",
        "the data's own licence",
        "Dolly- or Alpaca-format instructions from a hub id or local json/jsonl/parquet "
        "(option path)",
    )
)
def hf_source(
    path: str, split: str = "train", fmt: Format = "auto", test_split: str | None = None
) -> LoadedSource:
    """Instruction data from ``path`` (hub id or local file); ``test_split`` adds a held-out split.

    Test ids are shifted past the largest train id so that train and test ids stay disjoint.
    """
    train = load_instruction_dataset(path, split, fmt)
    test = None
    if test_split is not None:
        test = load_instruction_dataset(path, test_split, fmt)
        cols = test.to_pandas()
        cols["id"] += int(np.max(np.asarray(train["id"]), initial=-1)) + 1
        test = instruction_dataset({k: cols[k].to_numpy() for k in cols.columns})
    return LoadedSource(source_info("hf"), train, test)
