"""The client half on Flower: a ClientApp that serves one fedfm client per SuperNode.

Each SuperNode serves the client whose index in the task's ``client_ids()`` is its node
config's ``partition-id`` (Flower's simulation engine sets it per virtual node; a
deployment SuperNode is started with it). The task and the algorithm's client half are built
from the run config once per process and cached (:func:`fedfm.engine.build_clients`: no
server half is built in a client's process), and every message goes through the same
:meth:`fedfm.core.federation.ClientRunner.call` as on the embedded runtime: unknown kinds and
wrong roles are refused with a named :class:`~fedfm.errors.MessageError`, torch is seeded from
(seed, round, client, kind), declared fields are checked both ways.

Client state lives in Flower's ``context.state`` and, for resume, in snapshots on the
node's disk (node config ``state-dir``): one per (server session, round) in which the state
changed, written only when the handler succeeded and its reply passed the server's checks.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedfm.core.codec import Wire
from fedfm.core.federation import error_reason
from fedfm.core.state import ClientState, load_state, save_state
from fedfm.engine import build_clients
from fedfm.errors import ConfigError, MessageError
from fedfm.runtime.flower.wire import (
    CLIENT_ERROR_CODE,
    HEADER,
    Payload,
    arrays_to_record,
    like_templates,
    message_to_records,
    record_to_arrays,
    records_to_message,
)

if TYPE_CHECKING:
    from flwr.app import Context
    from flwr.app import Message as FlowerMessage

log = logging.getLogger("fedfm")

STATE_ARRAYS = "fedfm.state.arrays"
STATE_META = "fedfm.state.meta"
STATE_MARK = "fedfm.state.mark"
DEFAULT_STATE_DIR = Path.home() / ".cache" / "fedfm" / "client-states"


class ClientRuntime:
    """What one process needs to serve clients of one run: the algorithm's client half.

    Args:
        payload: The run's payload.
        device: This node's ``device`` in place of the run's (node config ``device``).
    """

    def __init__(self, payload: Payload, device: str | None = None) -> None:

        self.payload = payload
        self.cfg = payload.run_config(device)
        self.options = payload.flower()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.setup = build_clients(self.cfg)  # the client half alone: no server half here
        self.runner = self.setup.client_runner()
        self.cids = self.setup.task.client_ids()

    def client_id(self, node_config: dict[str, Any]) -> str:
        """The client this SuperNode serves, from its ``partition-id``.

        Raises:
            ConfigError: The partition id is missing or does not fit the task.
        """
        pid = node_config.get("partition-id")
        if pid is None:
            raise ConfigError("partition-id", "missing from the SuperNode's node config")
        n = node_config.get("num-partitions")
        if n is not None and int(n) != len(self.cids):
            raise ConfigError(
                "num-partitions", f"SuperNode says {n}, the task has {len(self.cids)} clients"
            )
        if not 0 <= int(pid) < len(self.cids):
            raise ConfigError("partition-id", f"{pid} is out of range for {len(self.cids)} clients")
        return self.cids[int(pid)]

    def state_root(self, node_config: dict[str, Any]) -> Path:
        """Folder of this node's client-state snapshots."""
        chosen = node_config.get("state-dir") or self.options.state_dir
        return Path(str(chosen)) if chosen else DEFAULT_STATE_DIR


# One run per process at a time is the common case; two covers a run handing over to the next.
_RUNTIMES: OrderedDict[str, ClientRuntime] = OrderedDict()


def runtime_for(payload: Payload, device: str | None = None) -> ClientRuntime:
    """The cached :class:`ClientRuntime` of a payload on a device (built on first use)."""
    key = payload.key() + (f"@{device}" if device else "")
    if key not in _RUNTIMES:
        _RUNTIMES[key] = ClientRuntime(payload, device)
        while len(_RUNTIMES) > 2:
            _RUNTIMES.popitem(last=False)
    _RUNTIMES.move_to_end(key)
    return _RUNTIMES[key]


# --------------------------------------------------------------------------- snapshots


class Snapshots:
    """One client's state snapshots on the node's disk, named by (session, round).

    Args:
        root: The node's state folder.
        run_uid: The run's identity (a fresh run never sees an earlier run's states).
        cid: Client id.
    """

    def __init__(self, root: Path, run_uid: str, cid: str) -> None:
        self.folder = root / run_uid / cid

    def _all(self) -> list[tuple[int, int]]:
        if not self.folder.exists():
            return []
        out = []
        for p in self.folder.glob("s*-r*.json"):
            s, r = p.stem[1:].split("-r")
            out.append((int(s), int(r)))
        return out

    @staticmethod
    def _valid(snap: tuple[int, int], session: int, lineage: list[list[int]]) -> bool:
        s, r = snap
        if s == session:
            return True
        return any(s == ls and r <= end for ls, end in lineage)

    def _stem(self, s: int, r: int) -> str:
        return f"s{s:04d}-r{r:05d}"

    def latest(self, session: int, lineage: list[list[int]]) -> ClientState | None:
        """The newest snapshot valid in this session's history, or None."""
        valid = [x for x in self._all() if self._valid(x, session, lineage)]
        if not valid:
            return None
        s, r = max(valid, key=lambda x: (x[1], x[0]))
        return load_state(self.folder, self._stem(s, r))

    def save(self, state: ClientState, session: int, rnd: int) -> None:
        """Writes a snapshot (its JSON last, so a half-written one is never read)."""
        save_state(state, self.folder, self._stem(session, rnd))

    def prune(self, session: int, lineage: list[list[int]], committed: int) -> None:
        """Keeps the newest valid snapshot of a committed round and any newer ones."""
        snaps = self._all()
        valid = [x for x in snaps if self._valid(x, session, lineage)]
        done = [x for x in valid if x[1] <= committed]
        keep = {x for x in valid if x[1] > committed}
        if done:
            keep.add(max(done, key=lambda x: (x[1], x[0])))
        for s, r in snaps:
            if (s, r) not in keep:
                stem = self._stem(s, r)
                (self.folder / f"{stem}.json").unlink(missing_ok=True)
                (self.folder / f"{stem}.safetensors").unlink(missing_ok=True)


# --------------------------------------------------------------------------- context state


def _mark(head: dict[str, Any], cid: str) -> str:
    return json.dumps([head["run_uid"], head["session"], cid])


def context_state(
    context: Context, head: dict[str, Any], cid: str, snaps: Snapshots
) -> ClientState:
    """This client's state: Flower's context state or the newest valid snapshot.

    Flower's context state if it belongs to this session, else the newest valid snapshot on disk (a
    resumed run, or a SuperNode that restarted).
    """
    st = context.state
    configs = st.config_records
    if STATE_MARK in configs and str(configs[STATE_MARK]["mark"]) == _mark(head, cid):
        records = st.array_records
        arrays = record_to_arrays(records[STATE_ARRAYS]) if STATE_ARRAYS in records else {}
        meta = json.loads(str(configs[STATE_META]["json"])) if STATE_META in configs else {}
        return ClientState(arrays=arrays, meta=meta)
    found = snaps.latest(head["session"], head.get("lineage", []))
    state = found or ClientState()
    store_state(context, head, cid, state)
    return state


def store_state(context: Context, head: dict[str, Any], cid: str, state: ClientState) -> None:
    """Writes a client state into Flower's context state."""
    from flwr.app import ConfigRecord

    context.state[STATE_MARK] = ConfigRecord({"mark": _mark(head, cid)})
    context.state[STATE_ARRAYS] = arrays_to_record(state.arrays)
    context.state[STATE_META] = ConfigRecord({"json": json.dumps(state.meta)})


def _changed(old: ClientState, new: ClientState) -> bool:
    # Handlers replace tensors rather than edit them in place (as on the embedded runtime),
    # so identity tells whether an array changed.
    if old.meta != new.meta or old.arrays.keys() != new.arrays.keys():
        return True
    return any(old.arrays[k] is not new.arrays[k] for k in old.arrays)


# --------------------------------------------------------------------------- handlers


def _payload(context: Context, payload: Payload | None) -> Payload:
    return payload or Payload.from_context(context.run_config)


def _runtime(context: Context, payload: Payload | None) -> ClientRuntime:
    """This node's runtime, on the node's own ``device`` when its node config names one."""
    device = context.node_config.get("device")
    return runtime_for(_payload(context, payload), str(device) if device else None)


def _error(message: FlowerMessage, err: BaseException) -> FlowerMessage:
    from flwr.app import Error
    from flwr.app import Message as FlowerMessage

    return FlowerMessage(Error(code=CLIENT_ERROR_CODE, reason=error_reason(err)), reply_to=message)


def handle_hello(
    message: FlowerMessage, context: Context, payload: Payload | None = None
) -> FlowerMessage:
    """Handshake: tells the server which client this SuperNode serves (and warms caches)."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.app import Message as FlowerMessage

    try:
        rt = _runtime(context, payload)
        cid = rt.client_id(dict(context.node_config))
    except Exception as e:  # refused handshakes are reported to the server, never crash
        log.error("handshake refused: %s", error_reason(e))
        return _error(message, e)
    content = RecordDict({HEADER: ConfigRecord({"header": json.dumps({"cid": cid})})})
    return FlowerMessage(content, reply_to=message)


def handle_message(
    message: FlowerMessage, context: Context, payload: Payload | None = None
) -> FlowerMessage:
    """Runs one fedfm message through the algorithm's client handlers.

    A failure of any kind (unknown kind, wrong role, a crashing handler, a reply that does
    not fit the expected shapes) is answered with a Flower error reply whose reason is the
    embedded runtime's one-line error, and the client's state is left as it was.
    """
    from flwr.app import Message as FlowerMessage

    try:
        rt = _runtime(context, payload)
        cid = rt.client_id(dict(context.node_config))
        msg, head = records_to_message(message.content)
        if str(head.get("cid")) != cid:
            raise MessageError(f"message for client {head.get('cid')} reached client {cid}")
        snaps = Snapshots(rt.state_root(dict(context.node_config)), head["run_uid"], cid)
        saved = context_state(context, head, cid, snaps)
        rnd = int(head["round"])
        # The server checks the reply too; checking it here against the expected shapes
        # keeps a reply the server would reject from committing the state, as on embedded.
        like = like_templates(head.get("like", {}))
        reply, state = rt.runner.call(cid, rnd, saved, msg, like)
        wire = Wire.of(**head["comm"]) if "comm" in head else None
        content = message_to_records(reply, {}, wire, "up")
        if _changed(saved, state):
            snaps.save(state, int(head["session"]), rnd)
            snaps.prune(int(head["session"]), head.get("lineage", []), int(head["committed"]))
            store_state(context, head, cid, state)
    except Exception as e:  # a failed client answers with its error, never crashes the node
        return _error(message, e)
    return FlowerMessage(content, reply_to=message)
