"""Files an algorithm leaves in the run folder: distilled sets, selection logs, synthetic data.

Every :class:`~fedfm.algorithms.base.Algorithm` has ``self.artefacts`` (an :class:`Artefacts`).
The server half writes through it (:meth:`Artefacts.write_text`, :meth:`Artefacts.write_json`,
:meth:`Artefacts.append_jsonl`, :meth:`Artefacts.write_bytes`); writes are staged in memory
and the engine, at the end of each round (and after :meth:`Algorithm.finish`):

1. **publishes** them into ``<run>/artefacts/``, each file written under a temporary name and
   renamed, so a reader never sees half a file; ``artefacts/index.json`` lists every file fedfm
   wrote there, and is updated before the files;
2. **checkpoints** their contents with the round;
3. lists them, with sizes and SHA-256, in ``summary.json``.

On ``--resume`` the checkpoint's contents are published again and files that a later,
unfinished round had published are removed (only files the index lists: fedfm never removes a
file it did not write), so a resumed run ends with the same artefacts as an uninterrupted one.

Contents live in memory and in every checkpoint: this is for data sets and logs of megabytes,
not for model weights (those belong in the algorithm's state or the client states).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedfm.errors import FedfmError

FOLDER = "artefacts"
INDEX = "index.json"
PREFIX = "__artefact__/"  # key prefix of artefact contents among a checkpoint's server arrays
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")


class Artefacts:
    """The files an algorithm leaves in its run folder (see the module doc)."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._dirty: set[str] = set()

    # ----- the algorithm's side -----
    def write_bytes(self, name: str, data: bytes) -> None:
        """Sets the content of ``artefacts/<name>`` (published at the end of the round).

        Args:
            name: A relative path of ``[A-Za-z0-9._-]`` parts separated by ``/``, not starting
                with a dot or a dash (e.g. ``distilled/client-3.jsonl``); ``index.json`` is
                reserved.
            data: The file's content.

        Raises:
            FedfmError: The name is not allowed.
        """
        if not _NAME.match(name) or name == INDEX:
            raise FedfmError(f"artefact name {name!r} is not allowed (e.g. 'selection.jsonl')")
        self._files[name] = bytes(data)
        self._dirty.add(name)

    def write_text(self, name: str, text: str) -> None:
        """Sets a UTF-8 text artefact."""
        self.write_bytes(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        """Sets a JSON artefact (indented)."""
        self.write_text(name, json.dumps(obj, indent=1) + "\n")

    def append_jsonl(self, name: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Appends one JSON line per row to a JSON-lines artefact (created when missing)."""
        lines = "".join(json.dumps(dict(row)) + "\n" for row in rows)
        self.write_bytes(name, self._files.get(name, b"") + lines.encode())

    def read_bytes(self, name: str) -> bytes:
        """The current content of an artefact.

        Raises:
            FedfmError: No such artefact.
        """
        if name not in self._files:
            raise FedfmError(f"no artefact named {name!r}")
        return self._files[name]

    def read_json(self, name: str) -> Any:
        """The current content of a JSON artefact."""
        return json.loads(self.read_bytes(name))

    def names(self) -> list[str]:
        """Every artefact, sorted."""
        return sorted(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def manifest(self) -> dict[str, dict[str, Any]]:
        """``{"artefacts/<name>": {"bytes", "sha256"}}`` of every artefact."""
        return {
            f"{FOLDER}/{name}": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in sorted(self._files.items())
        }

    # ----- the engine's side -----
    def publish(self, root: Path) -> None:
        """Writes changed artefacts into ``root/artefacts/`` atomically, index first."""
        if not self._dirty:
            return
        folder = root / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / INDEX, _index_text(sorted(set(_read_index(folder)) | set(self._files))))
        for name in sorted(self._dirty):
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, self._files[name])
        self._dirty.clear()

    def state(self) -> dict[str, Tensor]:
        """Contents as ``uint8`` tensors under ``__artefact__/<name>`` (for a checkpoint)."""
        return {PREFIX + name: _as_tensor(data) for name, data in self._files.items()}

    def restore(self, root: Path, arrays: Mapping[str, Tensor]) -> None:
        """Takes the contents of a checkpoint and makes the run folder show exactly them.

        Files in ``root/artefacts/`` that the index lists but the checkpoint lacks (published
        by a round that did not complete) are removed; the others are written again.
        """
        self._files = {
            key[len(PREFIX) :]: bytes(value.numpy().tobytes())
            for key, value in arrays.items()
            if key.startswith(PREFIX)
        }
        folder = root / FOLDER
        stale = [name for name in _read_index(folder) if name not in self._files]
        for name in stale:
            (folder / name).unlink(missing_ok=True)
        if folder.exists():
            _write(folder / INDEX, _index_text(sorted(self._files)))
        self._dirty = set(self._files)
        self.publish(root)


def split_state(arrays: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(algorithm arrays, artefact arrays)`` of a checkpoint's server arrays."""
    own = {k: v for k, v in arrays.items() if not k.startswith(PREFIX)}
    return own, {k: v for k, v in arrays.items() if k.startswith(PREFIX)}


def _as_tensor(data: bytes) -> Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _read_index(folder: Path) -> list[str]:
    path = folder / INDEX
    if not path.exists():
        return []
    try:
        names = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return []  # a damaged index names nothing, so nothing is removed
    return [n for n in names if isinstance(n, str) and _NAME.match(n) and n != INDEX]


def _index_text(names: list[str]) -> bytes:
    return (json.dumps({"files": names}, indent=1) + "\n").encode()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
