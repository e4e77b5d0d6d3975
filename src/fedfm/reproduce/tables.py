"""Markdown of the study reports.

Numbers, rows, headers, difference markers, the reports' fixed text (:class:`Text`), and the
figures' mean ± SE bands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import numpy as np

from fedfm import plots
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
    """Which side a difference favours by more than 2 SE (``sign`` −1: lower is better)."""
    if est.n < 2 or not math.isfinite(est.se):
        return "no SE (one value): not resolved"
    r = est.resolved() * sign
    return f"{up} (> 2 SE)" if r > 0 else f"{down} (> 2 SE)" if r < 0 else "not resolved (≤ 2 SE)"


def ratio(ref: float | None, x: float | None) -> str:
    """How many times ``x`` fits in ``ref`` (e.g. a speed-up), ``12.3×``; a dash without both."""
    return f"{ref / x:.1f}×" if ref and x and x > 0 else DASH


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


def joined(*parts: str | Sequence[str]) -> str:
    """:func:`blocks` as one text, without the blank line after the last block."""
    return "\n".join(blocks(*parts)[:-1])


def blocks(*parts: str | Sequence[str]) -> list[str]:
    """Markdown blocks, each followed by a blank line.

    A string is one line (a heading, a paragraph), a sequence of lines one block (a table, a list;
    empty: the blank line only).
    """
    return [x for p in parts for x in [*([p] if isinstance(p, str) else p), ""]]


def values(xs: Iterable[Any]) -> str:
    """A set of grid values, ``{1, 2, 4}``."""
    return "{" + ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs) + "}"


def band(ax: Any, x: Sequence[int], ests: Sequence[Estimate], alpha: float, **line: Any) -> None:
    """Means over ``x`` as a line (``line``: its style, ``color`` included) in a ± SE band."""
    mu = np.array([e.mean for e in ests])
    se = np.array([e.se if e.n > 1 else 0.0 for e in ests])
    ax.plot(x, mu, **line)
    ax.fill_between(x, mu - se, mu + se, alpha=alpha, color=line["color"])


def save(fig: Any, path: Path, dpi: int) -> Path:
    """Lays a figure out and writes it to ``path`` (its folder created)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    plots.save(fig, str(path), dpi=dpi)
    return path


_SECTION = re.compile(r"^<!-- section: ([\w.-]+) -->\n", re.M)
_ALONE = re.compile(r"\$(?:([_a-zA-Z][_a-zA-Z0-9]*)|\{([_a-zA-Z][_a-zA-Z0-9]*)\})")


class Text:
    """A study's fixed report text, ``<folder>/<name>.md`` (the package's ``reports/``).

    Its sections open with ``<!-- section: NAME -->`` and are :class:`string.Template` s filled as
    ``docs/studies.md`` ("Report text") describes.
    """

    def __init__(self, name: str, folder: Path | None = None) -> None:
        folder = folder or Path(str(resources.files("fedfm.reproduce") / "reports"))
        self.path = folder / f"{name}.md"

    @cached_property
    def sections(self) -> dict[str, str]:
        """Section name -> its template text (ValueError for a name that stands twice)."""
        parts = _SECTION.split(self.path.read_text(encoding="utf-8"))
        if len(set(parts[1::2])) < len(parts[1::2]):
            raise ValueError(f"{self.path}: a section name stands twice")
        return {k: v.strip("\n") for k, v in zip(parts[1::2], parts[2::2], strict=True)}

    def __call__(self, section: str, *sources: Mapping[str, Any], **values: Any) -> str:
        """The section filled from ``sources`` (e.g. ``vars(grid)``), then ``values``.

        A KeyError for no such section or a placeholder without a value, a ValueError for a ``$``
        that starts no placeholder.
        """
        if section not in self.sections:
            raise KeyError(f"{self.path}: no section {section!r}")
        values = {k: v for src in sources for k, v in src.items()} | values
        kept: list[str] = []
        separator = False  # a dropped paragraph's blank line goes too
        for line in self.sections[section].split("\n"):
            if separator and not line:
                separator = False
                continue
            alone = _ALONE.fullmatch(line)
            value = values.get(alone[1] or alone[2], "") if alone else ""
            separator = value is None and (not kept or not kept[-1])
            if value is None or (isinstance(value, list) and not value):
                continue
            kept.append(line)
        if separator and kept:  # a dropped last paragraph: the blank line before it
            kept.pop()
        filled = {
            k: "\n".join(row(x) if isinstance(x, list) else str(x) for x in v)
            if isinstance(v, list)
            else str(v)
            for k, v in values.items()
            if v is not None
        }
        try:
            return Template("\n".join(kept)).substitute(filled)
        except KeyError as e:
            raise KeyError(f"{self.path}, section {section!r}: no value for ${e.args[0]}") from None
        except ValueError as e:  # a "$" that starts no placeholder ("$$" is a dollar sign)
            raise ValueError(f"{self.path}, section {section!r}: {e}") from None
