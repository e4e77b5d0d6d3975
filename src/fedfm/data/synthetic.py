"""A synthetic text set left by a run, as an ordinary text-classification source.

DP text generation (:mod:`fedfm.algorithms.dpsyn`) leaves ``artefacts/synthetic.jsonl`` (one
JSON object per line with ``code``, ``label`` and ``text``) and ``artefacts/heldout.json`` (the
real source, its options, its class names and the sample ids of the run's held-out test rows).
The ``synthetic`` source reads both: its training rows are the synthetic texts, its test split
is the real held-out set of that run, so any downstream task (``task.kind: text``) trains on
synthetic data only and is tested on real data::

    fedfm run fedrd-text task.dataset=synthetic \
        task.source_options.path=runs/dpsyn-rotten-tomatoes/artefacts/synthetic.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedfm.data.sources import (
    LoadedSource,
    SourceInfo,
    load_source,
    register_source,
    source_info,
)
from fedfm.data.sources.text import _text_dataset
from fedfm.errors import ConfigError

HELDOUT = "heldout.json"


def read_jsonl(path: Path, field: str = "task.source_options.path") -> list[dict[str, object]]:
    """The rows of a JSON-lines file (blank lines skipped).

    Raises:
        ConfigError: The file is missing or a line is not a JSON object (naming ``field``).
    """
    if not path.is_file():
        raise ConfigError(field, f"file not found: {path}")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise ConfigError(field, f"{path} line {n} is not a JSON object")
        rows.append(row)
    return rows


@register_source(
    SourceInfo(
        "synthetic",
        "text-classification",
        "(a run folder)",
        "as the real source the run generated from",
        "a run's synthetic texts (train) with that run's real held-out rows (test)",
    )
)
def synthetic(path: str, heldout: str | None = None) -> LoadedSource:
    """A run's synthetic set (``path``) with its real held-out split (``heldout``).

    Args:
        path: A JSON-lines file with ``label`` (class index) and ``text`` per row.
        heldout: The held-out description (``heldout.json``); the file beside ``path`` when
            ``None``.

    Raises:
        ConfigError: A file is missing or malformed, a label is out of range, or a held-out
            id is not a row of the real source (field ``task.source_options.path``).
    """
    file = Path(path).expanduser()
    meta_path = Path(heldout).expanduser() if heldout else file.with_name(HELDOUT)
    if not meta_path.is_file():
        raise ConfigError("task.source_options.heldout", f"file not found: {meta_path}")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    names = [str(n) for n in meta["class_names"]]
    rows = read_jsonl(file)
    raw = [row.get("label") for row in rows]
    labels = [y for y in raw if isinstance(y, int) and 0 <= y < len(names)]
    if len(labels) != len(raw):
        raise ConfigError(
            "task.source_options.path", f"{file}: every row needs a label in [0, {len(names)})"
        )
    real = load_source(meta["dataset"], **meta.get("source_options", {}))
    wanted = np.asarray(meta["ids"], dtype=np.int64)
    # Synthetic ids follow every real id, so no synthetic row shares an id with a real one.
    first = 1 + max(int(np.max(s["id"])) for s in (real.train, real.test) if s is not None)
    train = _text_dataset(
        range(first, first + len(rows)), [str(r["text"]) for r in rows], labels, names
    )
    parts = []
    for split in (real.train, real.test):
        if split is None:
            continue
        ids = np.asarray(split["id"], dtype=np.int64)
        parts.append((split, np.flatnonzero(np.isin(ids, wanted))))
    found = sum(len(idx) for _, idx in parts)
    if found != len(wanted):
        raise ConfigError(
            "task.source_options.heldout",
            f"{len(wanted) - found} held-out ids are not rows of '{meta['dataset']}'",
        )
    texts: list[str] = []
    ys: list[int] = []
    sids: list[int] = []
    for split, idx in parts:
        sub = split.select(idx.tolist())
        texts += [str(t) for t in sub["text"]]
        ys += [int(y) for y in sub["label"]]
        sids += [int(i) for i in sub["id"]]
    test = _text_dataset(sids, texts, ys, names)
    return LoadedSource(source_info("synthetic"), train, test, len(names), names)
