"""Terminal display of a run: a progress bar over rounds and a per-round table.

The display shows a few columns that fit an 80-column terminal; every metric of every round
is in the run's ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedfm.config import RunConfig

MIB = 2**20  # bytes per MiB, as in reports and plots (the ledger counts bytes)

_ANNOUNCE: list[Callable[[], None]] = []


@contextmanager
def announce_at_start(announce: Callable[[], None]) -> Iterator[None]:
    """Defers ``announce`` until the next run display opens.

    Defers ``announce`` (e.g. the command's memory-plan and device lines) until the next
    run display opens: the engine opens it only once the config, the built task and algorithm
    and the run folder have passed every check, so a refused run prints its one error line
    and nothing else.

    A module-level slot, not a parameter, because the display opens in whichever runtime runs
    the engine (the Flower simulation runs it in a thread of this process).
    """
    _ANNOUNCE.append(announce)
    try:
        yield
    finally:
        if announce in _ANNOUNCE:
            _ANNOUNCE.remove(announce)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _mb(v: Any) -> str:
    if not isinstance(v, int | float):
        return ""
    mb = v / MIB
    return f"{mb:.3f}" if mb < 10 else f"{mb:.1f}" if mb < 1000 else f"{mb:.0f}"


def _columns(rows: list[dict[str, Any]], primary: str) -> list[tuple[str, str]]:
    """``(header, metric key)`` pairs that fit 80 columns.

    The headline metric, test and train loss, clients answering and failing, and MiB up and down.
    Everything else stays in metrics.jsonl.
    """
    keys = {k for r in rows for k in r}
    cols = [(primary, primary)] if primary in keys else []
    cols += [(k, k) for k in ("loss", "train_loss", "clients") if k in keys and k != primary]
    if any(r.get("failed") for r in rows):
        cols.append(("failed", "failed"))
    cols += [("MiB up", "bytes_up"), ("MiB down", "bytes_down")]
    return cols


def _cell(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return ""
    return _mb(row[key]) if key.startswith("bytes") else _fmt(row[key])


def round_table(rows: list[dict[str, Any]], primary: str) -> Table:
    """All rounds as one table (see :func:`_columns` for the columns)."""
    cols = _columns(rows, primary)
    table = Table(title="rounds", show_edge=False)
    for header, _ in [("round", "round"), *cols]:
        table.add_column(header, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r["round"]), *(_cell(r, k) for _, k in cols))
    return table


class RoundDisplay:
    """A rich progress bar plus one table row per round.

    Args:
        cfg: The run config (name, rounds).
        enabled: Print nothing when False.
        start: Round the run starts (or resumes) from.
        primary: The task's headline metric, shown first.
        console: Where to print (default: the terminal's stderr).
    """

    def __init__(
        self,
        cfg: RunConfig,
        enabled: bool = True,
        start: int = 0,
        primary: str = "acc",
        console: Console | None = None,
    ) -> None:
        self.enabled = enabled
        self.primary = primary
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn(f"[bold]{cfg.name}[/] {cfg.algorithm}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not enabled,
        )
        self.task_id = self.progress.add_task("rounds", total=cfg.rounds, completed=start)

    def __enter__(self) -> RoundDisplay:
        while _ANNOUNCE:  # every check has passed: what the command deferred (printed once)
            _ANNOUNCE.pop(0)()
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, row: dict[str, Any]) -> None:
        """Prints one round's metrics and advances the bar."""
        if not self.enabled:
            return
        cols = [k for _, k in _columns([row], self.primary) if not k.startswith("bytes")]
        text = " ".join(f"{k}={_cell(row, k)}" for k in cols if k in row)
        mb = f"MiB {_cell(row, 'bytes_up')}/{_cell(row, 'bytes_down')}"
        # One line per round however many metrics: no hard line breaks at the console's width
        # (80 columns when the output is a file or a pipe).
        line = f"{row['round']:>4}  {text}  {mb}  {row['time_s']:.2f}s"
        self.progress.console.print(line, soft_wrap=True)
        if row["round"] > 0:
            self.progress.advance(self.task_id)

    def final_table(
        self, rows: list[dict[str, Any]], privacy: dict[str, Any] | None = None
    ) -> None:
        """Prints all rounds as one table, then the run's privacy guarantee.

        Prints all rounds as one table that fits 80 columns, then the run's privacy
        guarantee when DP was used.
        """
        if not self.enabled or not rows:
            return
        self.console.print(round_table(rows, self.primary))
        if privacy:
            self.console.print(
                f"privacy: epsilon = {privacy['epsilon']:.4g} at delta = {privacy['delta']:g}"
                f" (worst client, {privacy['accountant']} accountant; see privacy.json)"
                + (f"\n{privacy['warning']}" if privacy.get("warning") else "")
            )


def summary_line(summary: dict[str, Any], folder: Any) -> str:
    """The line a run ends with.

    Its headline metric (4 decimals) with its standard error where the evaluator logs one
    (``<primary>_se``), rounds, the headline's change since the first evaluation paired by
    item (where the summary has one), privacy guarantee when DP was used, and where to look:
    the run's ``report.html`` when it was written, else its folder.
    """
    final = summary["final"]
    primary = summary["primary"]
    value = final.get(primary, float("nan"))
    se = final.get(f"{primary}_se")
    spread = f" ± {se:.4f} SE" if isinstance(se, int | float) else ""
    msg = f"{summary['name']}: {primary}={value:.4f}{spread} after {summary['rounds']} rounds"
    change = summary.get("change")
    if change:
        ratio = abs(change["mean"]) / change["se"] if change["se"] > 0 else float("inf")
        msg += (
            f"; change since round {change['from_round']}: {change['mean']:+.4f}"
            f" ± {change['se']:.4f} SE ({ratio:.1f} SE, paired over {change['n']} items)"
        )
    if "privacy" in summary:
        msg += (
            f", epsilon={summary['privacy']['epsilon']:.3g} (delta={summary['privacy']['delta']:g})"
        )
    page = Path(folder) / "report.html"
    return f"{msg}  ->  {page if page.is_file() else folder}"
