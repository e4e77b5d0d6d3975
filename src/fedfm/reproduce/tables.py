"""Markdown of the study reports: numbers, rows, headers and difference markers, one way."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from fedfm.reproduce.stats import Estimate

DASH = "—"


def num(x: Any, digits: int = 3, signed: bool = False) -> str:
    """``x`` with ``digits`` decimals; an em dash for None, a non-number or a non-finite value."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(float(x)):
        return DASH
    return f"{float(x):{'+' if signed else ''}.{digits}f}"


def marked(est: Estimate | None, digits: int = 3) -> str:
    """A signed difference ``+m ± se``, with `` *`` when it lies more than 2 SE from zero."""
    if est is None or est.n == 0 or not math.isfinite(est.mean):
        return DASH
    mark = " *" if est.resolved() else ""
    return f"{num(est.mean, digits, signed=True)} ± {num(est.se, digits)}{mark}"


def side(est: Estimate, up: str, down: str, sign: int = 1) -> str:
    """Which side a paired difference favours by more than 2 SE (``sign`` −1 where lower is
    better), or that it is not resolved."""
    if est.n < 2 or not math.isfinite(est.se):
        return "no SE (one value): not resolved"
    r = est.resolved() * sign
    return f"{up} (> 2 SE)" if r > 0 else f"{down} (> 2 SE)" if r < 0 else "not resolved (≤ 2 SE)"


def ratio(ref: float, x: float) -> str:
    """How many times ``x`` fits in ``ref`` (e.g. a speed-up), ``12.3×``."""
    return f"{ref / x:.1f}×" if x > 0 else DASH


def row(cells: Iterable[Any]) -> str:
    """One table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def head(cells: Sequence[Any] | str) -> list[str]:
    """A table's header and rule; ``cells`` may be one string, its cells split by ``" | "``."""
    cells = cells.split(" | ") if isinstance(cells, str) else cells
    return [row(cells), "|" + "---|" * len(cells)]


def table(header: Sequence[Any] | str, rows: Iterable[Iterable[Any]]) -> list[str]:
    """A whole table."""
    return [*head(header), *(row(r) for r in rows)]


def command_lines(command: str) -> list[str]:
    """The report's "How to reproduce" heading and the command that writes it."""
    return ["## How to reproduce", "", "```", command, "```", ""]


def blocks(*parts: str | Sequence[str]) -> list[str]:
    """Markdown blocks, each followed by a blank line: a string is one line (a heading, a
    paragraph), a sequence of lines one block (a table, a list; empty: the blank line only)."""
    return [x for p in parts for x in [*([p] if isinstance(p, str) else p), ""]]


def values(xs: Iterable[Any]) -> str:
    """A set of grid values, ``{1, 2, 4}``."""
    return "{" + ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs) + "}"
