"""Checkpoints after every round: server state, client states, RNG states.

A checkpoint is written into a temporary folder, renamed into place, and only then named in
``checkpoints/LATEST``; a run killed at any instant therefore resumes from the last complete
round and never reads half a checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

KEEP = 2


@dataclass
class Checkpoint:
    """What a checkpoint holds.

    Attributes:
        rnd: Last completed round (0: after the one-off phases before round 1).
        server_arrays: The algorithm's server tensors.
        server_meta: The algorithm's server metadata and the engine's own.
        client_arrays: Flat ``"cid::key"`` tensors of all client states.
        client_meta: Client id -> metadata.
    """

    rnd: int
    server_arrays: dict[str, Tensor]
    server_meta: dict[str, Any]
    client_arrays: dict[str, Tensor]
    client_meta: dict[str, Any]


def rng_state() -> dict[str, Any]:
    """The global RNG states (torch, numpy, random) as JSON-able values."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "random": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores states saved by :func:`rng_state`."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    r = state["random"]
    random.setstate((r[0], tuple(r[1]), r[2]))


def _contig(arrays: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().contiguous() for k, v in arrays.items()}


def save_checkpoint(folder: Path, ckpt: Checkpoint) -> Path:
    """Writes ``ckpt`` atomically under ``folder`` and prunes old ones.

    Returns:
        The checkpoint's folder.
    """
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"round_{ckpt.rnd:04d}"
    tmp = folder / f".round_{ckpt.rnd:04d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_contig(ckpt.server_arrays), str(tmp / "server.safetensors"))
    save_file(_contig(ckpt.client_arrays), str(tmp / "clients.safetensors"))
    meta = {"round": ckpt.rnd, "server": ckpt.server_meta, "clients": ckpt.client_meta}
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    mark_latest(folder, final)
    rounds = sorted(p for p in folder.glob("round_*") if p.is_dir())
    for old in rounds[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def mark_latest(folder: Path, path: Path) -> None:
    """Names checkpoint ``path`` in ``folder/LATEST`` (atomically)."""
    latest_tmp = folder / "LATEST.tmp"
    latest_tmp.write_text(path.name)
    latest_tmp.replace(folder / "LATEST")


def _round_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("round_"))
    except ValueError:
        return -1


def checkpoints_newest_first(folder: Path) -> list[Path]:
    """Checkpoint folders to try on resume, best first.

    The one named by ``LATEST`` comes first, then older ones by round. Without a readable
    ``LATEST``, every ``round_*`` folder counts, newest first (each was renamed into place
    only once complete). Whether one actually loads is for the caller to find out.
    """
    if not folder.is_dir():
        return []
    rounds = sorted(
        (p for p in folder.glob("round_*") if p.is_dir() and _round_of(p) >= 0),
        key=_round_of,
        reverse=True,
    )
    try:
        named = folder / (folder / "LATEST").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return rounds
    if named not in rounds:
        return rounds
    return [named, *(p for p in rounds if _round_of(p) < _round_of(named))]


def latest_checkpoint(folder: Path) -> Path | None:
    """The folder named by ``LATEST``, or None when there is no complete checkpoint."""
    latest = folder / "LATEST"
    if not latest.exists():
        return None
    path = folder / latest.read_text().strip()
    return path if (path / "meta.json").exists() else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Reads a checkpoint folder written by :func:`save_checkpoint`."""
    meta = json.loads((path / "meta.json").read_text())
    return Checkpoint(
        rnd=meta["round"],
        server_arrays=dict(load_file(str(path / "server.safetensors"))),
        server_meta=meta["server"],
        client_arrays=dict(load_file(str(path / "clients.safetensors"))),
        client_meta=meta["clients"],
    )
