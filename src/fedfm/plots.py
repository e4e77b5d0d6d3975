"""Figures that read at a glance, shared by run reports and study reports.

Conventions (every figure fedfm draws follows them):

* rounds are integers, so the round axis has integer ticks only;
* one figure per concern: a metric panel never holds counts (clients, examples) or sizes
  (bytes), which get figures of their own;
* a method keeps its colour across every figure of a report or study: :func:`colours` maps
  labels to colours in the order first given, the same order giving the same colours.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Colour-blind-safe qualitative palette (Okabe and Ito, 2008), then matplotlib's tab10.
PALETTE: tuple[str, ...] = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#D55E00",
    "#CC79A7",
    "#56B4E9",
    "#F0E442",
    "#000000",
    *(matplotlib.colors.to_hex(c) for c in plt.get_cmap("tab10").colors),  # type: ignore[attr-defined]
)

Series = Sequence[tuple[float, float]]
"""Points ``(round, value)`` of one line."""


def colours(labels: Iterable[str]) -> dict[str, str]:
    """A colour per distinct label, in first-seen order (the palette cycles after 18)."""
    out: dict[str, str] = {}
    for label in labels:
        if label not in out:
            out[label] = PALETTE[len(out) % len(PALETTE)]
    return out


def integer_rounds(ax: Axes) -> None:
    """Integer ticks on the round (x) axis."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def lines(
    series: Mapping[str, Series],
    title: str,
    ylabel: str,
    palette: Mapping[str, str] | None = None,
    styles: Mapping[str, str] | None = None,
) -> Figure:
    """One panel: a line per label over rounds (markers where a line has few points).

    Args:
        series: Label -> points ``(round, value)``; empty series are left out of the legend.
        title: Panel title.
        ylabel: The y axis's label.
        palette: Label -> colour (:func:`colours` of the labels when None). A label of the
            form ``"<method> (<variant>)"`` takes the colour of ``<method>`` when only the
            method is in the palette, so a method's variants share its colour.
        styles: Label -> matplotlib line style (e.g. ``"--"`` for a worst-client line).
    """
    palette = palette or colours(series)
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    for label, pts in series.items():
        if not pts:
            continue
        base = label.split(" (")[0]
        colour = palette.get(label) or palette.get(base)
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            (styles or {}).get(label, "-"),
            marker="o" if len(pts) <= 30 else None,
            ms=3,
            color=colour,
            label=label,
        )
    integer_rounds(ax)
    ax.ticklabel_format(axis="y", useOffset=False)  # a flat line keeps readable labels
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(series.values()):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bars(
    groups: Sequence[str],
    values: Mapping[str, Sequence[float | None]],
    title: str,
    ylabel: str,
    palette: Mapping[str, str] | None = None,
    lines: Mapping[str, Sequence[float | None]] | None = None,
) -> Figure:
    """Grouped bars: a group per entry of ``groups``, a bar per label (missing values: none).

    Args:
        groups: Group names along the x axis (e.g. domains, clients).
        values: Label -> one value per group (``None`` where the label has none).
        title: Panel title.
        ylabel: The y axis's label.
        palette: Label -> colour (:func:`colours` of the labels when None).
        lines: Baseline name -> one value per group, drawn as a horizontal line across the
            group's bars (e.g. the majority-class and uniform accuracies of each domain).
    """
    palette = palette or colours(values)
    n = max(1, len(values))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(groups) * n + 2), 3.4))
    for i, (label, vals) in enumerate(values.items()):
        xs = [g + (i - (n - 1) / 2) * width for g, v in enumerate(vals) if v is not None]
        ys = [v for v in vals if v is not None]
        ax.bar(xs, ys, width, label=label, color=palette.get(label))
    styles: tuple[Literal["--", ":", "-."], ...] = ("--", ":", "-.")
    for (name, vals), style in zip((lines or {}).items(), styles, strict=False):
        # One segment across each group's bars, one legend entry per baseline.
        xs = [g for g, v in enumerate(vals) if v is not None]
        ys = [v for v in vals if v is not None]
        ax.hlines(
            ys,
            [x - 0.45 for x in xs],
            [x + 0.45 for x in xs],
            colors="black",
            linestyles=style,
            lw=1.2,
            label=name,
        )
    ax.set_xticks(range(len(groups)), list(groups), rotation=30 if len(groups) > 6 else 0)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    if values or lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def png_base64(fig: Figure, dpi: int = 90) -> str:
    """The figure as a base64 PNG (for a ``data:`` URI); the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def save(fig: Figure, path: str, dpi: int = 90) -> None:
    """Writes the figure to ``path`` and closes it."""
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
