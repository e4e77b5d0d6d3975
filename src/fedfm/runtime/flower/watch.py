"""Following a run that another process writes: progress for ``fedfm serve``.

On the deployment engine the ServerApp runs the fedfm engine in a process that Flower
starts, and writes the run folder on the server machine. ``fedfm serve`` follows that
folder: each round that ``metrics.jsonl`` logs is shown as ``fedfm run`` shows it (one line
per round, a progress bar on a terminal), then the final table, and, when the run is
stopped, the round it can resume from.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from fedfm.config import RunConfig
from fedfm.core.runfolder import RunFolderError, read_json, read_jsonl
from fedfm.progress import RoundDisplay


def checkpoint_round(run_dir: Path) -> int:
    """Round of the run folder's newest checkpoint (where ``--resume`` continues), or -1."""
    if not (run_dir / "checkpoints").is_dir():
        return -1
    # Only here: the checkpoint module imports torch, which `fedfm serve` has no other use for.
    from fedfm.core.checkpoint import latest_checkpoint

    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        return -1
    try:
        return int(read_json(ck / "meta.json")["round"])
    except (RunFolderError, KeyError, OSError):
        return -1


class RunWatch:
    """Shows the rounds a run folder logs while another process runs them.

    Use as a context manager around the run; a thread polls ``metrics.jsonl``.

    Args:
        cfg: The run's config.
        run_dir: Its run folder (absolute).
        resume: The run continues the folder's last checkpoint.
        primary: The headline metric shown first while the run goes (the task's own, known
            for sure only from the summary at the end).
        enabled: Show anything at all.
        poll_s: Pause between two reads of ``metrics.jsonl``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: bool,
        primary: str,
        enabled: bool = True,
        poll_s: float = 0.5,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.shown = checkpoint_round(run_dir) if resume else -1
        # With --overwrite the old run's logs stay in place until the new run moves them
        # aside: rows count only once the folder is a new one (or the same one on resume).
        self.old = None if resume or not run_dir.exists() else run_dir.stat().st_ino
        self.display = RoundDisplay(cfg, enabled, start=max(self.shown, 0), primary=primary)
        self.poll_s = poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> RunWatch:
        self.display.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(5)
        self.poll()
        self.display.__exit__(*exc)

    def _follow(self) -> None:
        while not self._done.wait(self.poll_s):
            self.poll()

    def rows(self) -> list[dict[str, Any]]:
        """The rows of this run logged so far (none while an overwritten run's are there)."""
        try:
            if self.old is not None and self.run_dir.stat().st_ino == self.old:
                return []
            return read_jsonl(self.run_dir / "metrics.jsonl")
        except (OSError, RunFolderError):  # not there yet, or being replaced
            return []

    def poll(self) -> None:
        """Shows the rounds logged since the last poll."""
        with self._lock:
            for row in self.rows():
                if row["round"] > self.shown and "time_s" in row:
                    self.display.update(row)
                    self.shown = row["round"]

    def final_table(self, summary: dict[str, Any]) -> None:
        """Prints all rounds as ``fedfm run`` does at the end, headed by the task's metric."""
        self.display.primary = summary["primary"]
        self.display.final_table(self.rows(), summary.get("privacy"))

    def resume_line(self) -> str:
        """One line at the start of a resumed serve: the round it continues from."""
        rnd = checkpoint_round(self.run_dir)
        if rnd < 0:
            return f"{self.cfg.name}: no checkpoint to resume from: starting at round 0"
        return f"{self.cfg.name}: resuming from round {rnd} of {self.cfg.rounds} ({self.run_dir})"

    def stop_line(self, signum: int) -> str:
        """One line: the signal, the round the run stopped at, and how to go on."""
        name = signal.Signals(signum).name
        rnd = checkpoint_round(self.run_dir)
        if rnd < 0 and not self.run_dir.exists():
            return (
                f"{self.cfg.name}: stopped by {name} before round 0 (no run folder is left):"
                " start it again with the same command"
            )
        if rnd < 0:
            return (
                f"{self.cfg.name}: stopped by {name} before round 0 was saved: start it again"
                f" with the same command and --overwrite ({self.run_dir})"
            )
        return (
            f"{self.cfg.name}: stopped by {name} at round {rnd} of {self.cfg.rounds}: continue"
            f" with the same `fedfm serve` command and --resume ({self.run_dir})"
        )
