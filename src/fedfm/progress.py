"""Terminal display of a run: a progress bar over rounds and a per-round table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedfm.config import RunConfig

SKIP = {"round", "time_s"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _columns(rows: list[dict[str, Any]], limit: int = 9) -> list[str]:
    """Columns worth showing: headline metrics first, per-client detail last."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in SKIP and k not in keys]
    order = {k: i for i, k in enumerate(keys)}
    return sorted(keys, key=lambda k: ("/" in k, k.startswith("bytes"), order[k]))[:limit]


class RoundDisplay:
    """A rich progress bar plus one table row per round.

    Args:
        cfg: The run config (name, rounds).
        enabled: Print nothing when False.
        start: Round the run starts (or resumes) from.
    """

    def __init__(self, cfg: RunConfig, enabled: bool = True, start: int = 0) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
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
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, row: dict[str, Any]) -> None:
        """Prints one round's metrics and advances the bar."""
        if not self.enabled:
            return
        cols = _columns([row])
        text = "  ".join(f"{k}={_fmt(row[k])}" for k in cols)
        self.progress.console.print(f"round {row['round']:>3}  {text}  ({row['time_s']:.2f}s)")
        if row["round"] > 0:
            self.progress.advance(self.task_id)

    def final_table(
        self, rows: list[dict[str, Any]], privacy: dict[str, Any] | None = None
    ) -> None:
        """Prints all rounds as one table, then the run's privacy guarantee when DP was used."""
        if not self.enabled or not rows:
            return
        cols = _columns(rows)
        table = Table(title="rounds", show_edge=False)
        for c in ["round", *cols]:
            table.add_column(c, justify="right")
        for r in rows:
            table.add_row(str(r["round"]), *(_fmt(r.get(c, "")) for c in cols))
        self.console.print(table)
        if privacy:
            self.console.print(
                f"privacy: epsilon = {privacy['epsilon']:.4g} at delta = {privacy['delta']:g}"
                f" (worst client, {privacy['accountant']} accountant; see privacy.json)"
            )
