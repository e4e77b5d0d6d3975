"""Client state: what a client keeps across rounds, and the embedded runtime's store of it.

:class:`ClientState` is one client's persistent tensors and metadata (every runtime and
handler uses it). :class:`ClientStateStore` keeps the states of the embedded runtime: only
trainable per-client tensors (private models, local adapters, control variates) live
here; frozen shared models never do. States stay in memory up to a byte budget, and the
least recently used are spilled to disk as safetensors beyond it, so 100 simulated LLM
clients cost little more memory than one.
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from fedfm.core.groups import get_group
from fedfm.core.messages import Arrays, array_bytes


@dataclass
class ClientState:
    """Per-client state that persists across rounds and across resume.

    Attributes:
        arrays: Named tensors (private models, local adapters, control variates).
        meta: Small JSON-able values.
    """

    arrays: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def get_group(self, prefix: str) -> Arrays:
        """Returns the tensors stored under ``prefix/`` with the prefix removed."""
        return get_group(self.arrays, prefix)

    def set_group(self, prefix: str, arrays: Mapping[str, Tensor]) -> None:
        """Replaces the tensors under ``prefix/`` with detached CPU copies of ``arrays``."""
        p = prefix + "/"
        for k in [k for k in self.arrays if k.startswith(p)]:
            del self.arrays[k]
        for k, v in arrays.items():
            self.arrays[p + k] = v.detach().to("cpu", copy=True)

    def copy(self) -> ClientState:
        """A copy a handler may change freely without touching this state.

        Handlers replace tensors rather than edit them in place, so the tensor dict is copied
        shallowly (no tensor data is copied) and the metadata deeply.
        """
        return ClientState(arrays=dict(self.arrays), meta=copy.deepcopy(self.meta))


def save_state(state: ClientState, folder: Path, stem: str) -> None:
    """Writes one state as ``stem.safetensors`` + ``stem.json``.

    Each file is written under a temporary name and renamed into place, the JSON last, so a
    reader that finds ``stem.json`` finds the whole state (the presence of the JSON marks a
    complete state).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{stem}.tmp"
    save_file({k: v.contiguous() for k, v in state.arrays.items()}, str(tmp))
    os.replace(tmp, folder / f"{stem}.safetensors")
    tmp.write_text(json.dumps(state.meta))
    os.replace(tmp, folder / f"{stem}.json")


def load_state(folder: Path, stem: str) -> ClientState:
    """Reads a state written by :func:`save_state`."""
    arrays = load_file(str(folder / f"{stem}.safetensors"))
    meta = json.loads((folder / f"{stem}.json").read_text())
    return ClientState(arrays=dict(arrays), meta=meta)


class ClientStateStore:
    """Per-client states, in memory up to ``max_bytes`` and spilled to ``spill_dir`` beyond.

    Args:
        spill_dir: Folder for spilled states (created on first spill).
        max_bytes: Memory budget for the tensors of states kept in memory.
    """

    def __init__(self, spill_dir: Path, max_bytes: int = 512 * 2**20) -> None:
        self.spill_dir = spill_dir
        self.max_bytes = max_bytes
        self._mem: OrderedDict[str, ClientState] = OrderedDict()
        self._spilled: set[str] = set()

    def __contains__(self, cid: str) -> bool:
        return cid in self._mem or cid in self._spilled

    def ids(self) -> list[str]:
        """Ids of clients that have a state."""
        return sorted(set(self._mem) | self._spilled)

    def get(self, cid: str) -> ClientState:
        """The state of ``cid`` (empty if it has none yet)."""
        if cid in self._mem:
            self._mem.move_to_end(cid)
            return self._mem[cid]
        if cid in self._spilled:
            return load_state(self.spill_dir, cid)
        return ClientState()

    def put(self, cid: str, state: ClientState) -> None:
        """Stores the state of ``cid``, spilling least-recently-used states if over budget."""
        if not state.arrays and not state.meta and cid not in self:
            return
        self._mem[cid] = state
        self._mem.move_to_end(cid)
        self._spilled.discard(cid)
        self._spill()

    def _spill(self) -> None:
        used = sum(array_bytes(s.arrays) for s in self._mem.values())
        while used > self.max_bytes and len(self._mem) > 1:
            cid, state = self._mem.popitem(last=False)
            save_state(state, self.spill_dir, cid)
            self._spilled.add(cid)
            used -= array_bytes(state.arrays)

    def items(self) -> list[tuple[str, ClientState]]:
        """Every (client id, state), loading spilled ones."""
        return [(cid, self.get(cid)) for cid in self.ids()]

    def snapshot(self) -> dict[str, Any]:
        """Flat tensors and metadata of all states, for a checkpoint."""
        arrays, meta = {}, {}
        for cid, st in self.items():
            for k, v in st.arrays.items():
                arrays[f"{cid}::{k}"] = v
            meta[cid] = st.meta
        return {"arrays": arrays, "meta": meta}

    def restore(self, arrays: dict, meta: dict[str, Any]) -> None:
        """Replaces all states with those of a checkpoint snapshot."""
        self._mem.clear()
        self._spilled.clear()
        states: dict[str, ClientState] = {cid: ClientState(meta=m) for cid, m in meta.items()}
        for key, v in arrays.items():
            cid, k = key.split("::", 1)
            states.setdefault(cid, ClientState()).arrays[k] = v
        for cid, st in states.items():
            self.put(cid, st)
