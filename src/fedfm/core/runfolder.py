"""Run folders: the logs of a run, and how a run folder is created, replaced and resumed.

A run folder is the user's work (DESIGN.md principle 13):

* Nothing here is called before the whole experiment has been built and validated, so a bad
  config never creates, empties or changes a folder.
* ``--overwrite`` moves the old folder aside (one rename) and restores it if the new run fails
  before it has started (its round-0 checkpoint is written). Once it has started, the old
  run's files that fedfm writes (:data:`RUN_FILES`) are deleted and any other file in it is
  moved into the new folder: fedfm never removes a file it did not write.
* ``--resume`` reads everything it needs (logs, checkpoints) before it writes anything;
  damaged logs stop it with one line naming the file, and a damaged checkpoint falls back to
  the newest older one that loads (see :func:`fedfm.core.checkpoint.checkpoints_newest_first`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fedfm.errors import ConfigError

log = logging.getLogger("fedfm")

#: What fedfm writes at the top of a run folder (glob patterns). A module that writes a new
#: artefact into run folders adds its name here, so that ``--overwrite`` replaces it.
RUN_FILES: tuple[str, ...] = (
    "config.yaml",
    "partition.json",
    "metrics.jsonl",
    "client_metrics.jsonl",
    "failures.jsonl",
    "audit.jsonl",
    "summary.json",
    "privacy.json",
    "artefacts",
    "metrics.png",
    "bytes.png",
    "report.html",
    "eval_items.jsonl",
    "tensorboard",
    "flower_sessions.json",
    "flower_logs",
    "adapter",
    ".adapter.tmp",
    ".adapter.old",
    "lm_eval.json",
    "lm_eval.tmp",
    "checkpoints",
    "client_states",
    "flower_client_states",
    # Temporary files of atomic writes (file.tmp replaced onto file).
    "summary.tmp",
    "metrics.tmp",
    "failures.tmp",
    "client_metrics.tmp",
    "audit.tmp",
    "report.tmp",
    "eval_items.tmp",
    "flower_sessions.tmp",
)


class RunFolderError(ConfigError):
    """A file of a run folder cannot be read: the message names the file (exit code 2)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__("run folder", f"{path}: {reason}")


def written_by_fedfm(name: str) -> bool:
    """Whether a top-level entry of a run folder is one that fedfm writes."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in RUN_FILES)


def read_jsonl(path: Path, need_round: bool = True) -> list[dict[str, Any]]:
    """Rows of a JSON-lines log written by fedfm.

    A torn last line (a run killed mid-write) is skipped; anything else that is not a JSON
    object, or (with ``need_round``) lacks an integer ``round``, is damage.

    Raises:
        RunFolderError: The file is not UTF-8 or a line is damaged, naming file and line.
    """
    if not path.exists():
        return []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise RunFolderError(path, f"not UTF-8 text (byte {e.start})") from None
    rows = []
    for i, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                continue
            raise RunFolderError(path, f"line {i} is not valid JSON") from None
        if not isinstance(row, dict):
            raise RunFolderError(path, f"line {i} is not a JSON object")
        rnd = row.get("round")
        if need_round and (isinstance(rnd, bool) or not isinstance(rnd, int)):
            raise RunFolderError(path, f"line {i} has no integer 'round'")
        rows.append(row)
    return rows


def read_json(path: Path) -> Any:
    """A JSON file written by fedfm (``summary.json``, ``meta.json``).

    Raises:
        RunFolderError: The file is not UTF-8 or not valid JSON, naming it.
    """
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RunFolderError(path, f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RunFolderError(path, f"not valid JSON ({e.msg}, line {e.lineno})") from None


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replaces a JSON-lines file atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


class RunFolder:
    """Paths and append-only logs of one run folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.metrics = root / "metrics.jsonl"
        self.audit = root / "audit.jsonl"
        self.failures = root / "failures.jsonl"
        self.client_metrics = root / "client_metrics.jsonl"
        self.items = root / "eval_items.jsonl"
        self.checkpoints = root / "checkpoints"
        self.summary = root / "summary.json"
        self.privacy = root / "privacy.json"

    @property
    def logs(self) -> tuple[Path, ...]:
        """The per-round logs that a resume cuts back to its checkpoint."""
        return (self.metrics, self.failures, self.client_metrics, self.items, self.audit)

    def append(self, path: Path, rows: list[dict[str, Any]]) -> None:
        """Appends JSON lines and flushes them to disk."""
        if rows:
            with path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)

    def read_metrics(self) -> list[dict[str, Any]]:
        """Rounds logged so far (a torn last line from a killed write is skipped)."""
        return read_jsonl(self.metrics)

    def truncate(self, path: Path, upto_round: int) -> None:
        """Drops rows after ``upto_round`` from a JSON-lines log (atomically)."""
        if path.exists():
            write_jsonl(path, [r for r in read_jsonl(path) if r["round"] <= upto_round])


def _aside_name(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return root.with_name(f".{root.name}.replaced-{stamp}-{os.getpid()}")


class RunFolderLease:
    """Creates (or replaces) a run folder and undoes that if the run fails before it starts.

    Use as a context manager around the run, and call :meth:`started` once the new run has
    written its first checkpoint. An exception before that removes what this run wrote and
    puts a replaced folder back; after it, the folder is left as the run left it.

    Args:
        root: The run folder.
        resume: Continue the run in ``root`` (nothing is created, moved or removed).
        overwrite: Replace an existing ``root``.

    Raises:
        ConfigError: ``root`` exists and neither ``resume`` nor ``overwrite`` is given.
    """

    def __init__(self, root: Path, resume: bool = False, overwrite: bool = False) -> None:
        self.root = root
        self.resume = resume and root.exists()
        self.overwrite = overwrite
        self.aside: Path | None = None
        self.created = False
        self.done = False
        if resume and not root.exists():
            log.info("no run folder %s to resume: starting from the beginning", root)
        if root.exists() and not root.is_dir():
            raise ConfigError("name", f"{root} exists and is not a folder")
        if root.exists() and not resume and not overwrite:
            raise ConfigError(
                "name", f"run folder {root} exists: pass --resume to continue it or --overwrite"
            )

    def __enter__(self) -> RunFolder:
        if self.resume:
            return RunFolder(self.root)
        if self.root.exists():
            self.aside = _aside_name(self.root)
            self.root.rename(self.aside)
            log.info("kept %s as %s until the new run has started", self.root, self.aside)
        self.root.mkdir(parents=True)
        self.created = True
        return RunFolder(self.root)

    def started(self) -> None:
        """The new run has started: retire the folder it replaces (once)."""
        if self.done:
            return
        self.done = True
        if self.aside is not None:
            _retire(self.aside, self.root)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.started()
        elif not self.done and self.created:
            self._roll_back()

    def _roll_back(self) -> None:
        _remove_written(self.root)
        left = sorted(p.name for p in self.root.iterdir())
        if left:
            log.warning("%s keeps files fedfm did not write: %s", self.root, ", ".join(left))
        else:
            self.root.rmdir()
        if self.aside is None:
            return
        if left:
            log.warning("the replaced run stays in %s", self.aside)
        else:
            self.aside.rename(self.root)


def _remove_written(folder: Path) -> None:
    """Removes the entries fedfm writes at the top of ``folder``; leaves everything else."""
    for p in folder.iterdir():
        if written_by_fedfm(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def _retire(aside: Path, root: Path) -> None:
    """Deletes a replaced run's fedfm files and moves the user's own files into ``root``."""
    _remove_written(aside)
    for p in sorted(aside.iterdir()):
        target = root / p.name
        if not target.exists():
            p.rename(target)
    left = sorted(p.name for p in aside.iterdir())
    if left:
        log.warning("kept %s: %s also exist in the new run", aside, ", ".join(left))
    else:
        aside.rmdir()
