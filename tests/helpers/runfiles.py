"""Readers of what a run writes, on top of fedfm's own reader (``core.runfolder``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfm.core.runfolder import read_jsonl


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file fedfm wrote (a missing file has none)."""
    return read_jsonl(path, need_round=False)


def untimed_rows(path: Path) -> list[dict[str, Any]]:
    """The rows without timings (fields named ``*_s``, e.g. ``time_s``): what two runs of one
    seed must share to the bit."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in jsonl_rows(path)]
