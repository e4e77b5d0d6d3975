"""Optional TensorBoard logging of a run's per-round metrics and bytes (``log.tensorboard``).

Each round's numeric values (metrics, losses, ``bytes_*`` from the audit ledger, failed
clients, seconds) are written as scalars at step = round into ``<run>/tensorboard/``; open
them with ``tensorboard --logdir runs``. A resumed run appends to the same folder, so rounds
after the checkpoint that were logged before the interruption appear twice there (the JSON
logs, which are cut back on resume, stay the record).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

FOLDER = "tensorboard"


class TensorBoardLog:
    """Writes rows of ``metrics.jsonl`` as TensorBoard scalars; does nothing when disabled."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self._writer: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / FOLDER))

    def log(self, row: Mapping[str, Any]) -> None:
        """Logs one round's numeric values at step ``row["round"]``."""
        if self._writer is None:
            return
        step = int(row["round"])
        for key, value in row.items():
            if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
                group = (
                    "bytes" if key.startswith("bytes") else "run" if key in RUN_KEYS else "metrics"
                )
                self._writer.add_scalar(f"{group}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


RUN_KEYS = ("clients", "failed", "failed_messages", "time_s")
