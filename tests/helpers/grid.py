"""The in-memory Flower grid: fedfm's real ServerApp body and ClientApp in one process.

Every record crosses Flower's own protobuf serde, as on a deployment, so a run on this grid
must equal the embedded run of the same config to the bit.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from flwr import app as flwr_app
from flwr.common import serde

from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import server as S
from fedfm.runtime.flower import wire as W
from fedfm.runtime.flower_app import make_client_app
from helpers.runfiles import untimed_rows


def wire_trip(rd: Any) -> Any:
    """A RecordDict after a trip through Flower's protobuf serialisation."""
    raw = serde.recorddict_to_proto(rd).SerializeToString()
    proto = type(serde.recorddict_to_proto(flwr_app.RecordDict()))()
    proto.ParseFromString(raw)
    return serde.recorddict_from_proto(proto)


class FakeGrid:
    """An in-memory Flower grid: each message is answered by the ClientApp of its node.

    Contents and node states cross Flower's protobuf serde, as on a real deployment.

    Args:
        payload: The run's payload (the ClientApp reads it as from Flower's run config).
        num_nodes: SuperNodes; node ``i`` serves partition ``i``.
        state_dir: Root of the nodes' state folders.
        dead: Partitions whose node answers the handshake, then nothing.
        crash_after: Raise (a server crash) at the push after this many (the pushes of one
            exchange, up to the next pull, count as one: the server pushes message by
            message).
        node_config: Extra node-config entries.
    """

    def __init__(
        self,
        payload: W.Payload,
        num_nodes: int,
        state_dir: Path,
        dead: set[int] | None = None,
        crash_after: int | None = None,
        node_config: dict[str, Any] | None = None,
        num_partitions: int | None = None,
        events: dict[int, Any] | None = None,
    ) -> None:
        self.app = make_client_app()
        self.events = dict(events or {})
        self.state_dir = state_dir
        self.offline: set[int] = set()
        self.dead = dead or set()
        self.crash_after = crash_after
        self.pushes = 0
        self._pushing = False  # the last call pushed: the same exchange goes on
        self.pending: list[Any] = []
        self.run_config = {W.PAYLOAD_KEY: payload.encode()}
        self.contexts = {
            100 + i: flwr_app.Context(
                run_id=1,
                node_id=100 + i,
                node_config={
                    "partition-id": i,
                    "num-partitions": num_partitions or num_nodes,
                    "state-dir": str(state_dir / f"node{i}"),
                    **(node_config or {}),
                },
                state=flwr_app.RecordDict(),
                run_config=self.run_config,
            )
            for i in range(num_nodes)
        }

    def get_node_ids(self) -> list[int]:
        self._pushing = False
        return [n for n in self.contexts if n not in self.offline]

    def restart(self, node: int, new_node: int) -> None:
        """The SuperNode ``node`` comes back as ``new_node``: same node config, empty state."""
        old = self.contexts[node]
        self.contexts[new_node] = flwr_app.Context(
            run_id=1,
            node_id=new_node,
            node_config=dict(old.node_config),
            state=flwr_app.RecordDict(),
            run_config=self.run_config,
        )

    def push_messages(self, msgs: list[Any]) -> list[str]:
        rounds = {m.metadata.group_id for m in msgs}
        for rnd in [r for r in self.events if str(r) in rounds]:
            self.events.pop(rnd)(self)
        if not self._pushing:
            self.pushes += 1
            self._pushing = True
            if self.crash_after is not None and self.pushes > self.crash_after:
                raise KeyboardInterrupt("server killed")
        ids = []
        for m in msgs:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.pending.append(m)
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Any]:
        self._pushing = False
        out = []
        for m in list(self.pending):
            node = m.metadata.dst_node_id
            if m.metadata.message_id not in ids:
                continue
            if node - 100 in self.dead and m.metadata.message_type == W.MESSAGE_TYPE:
                continue  # answered the handshake, then died
            self.pending.remove(m)
            m.content = wire_trip(m.content)
            ctx = self.contexts[node]
            reply = self.app(message=m, context=ctx)
            ctx.state = wire_trip(ctx.state)
            if reply.has_content():
                reply.content = wire_trip(reply.content)
            out.append(reply)
        return out


class ReversedGrid(FakeGrid):
    """Answers one fedfm message per pull, the last one pushed first: replies come reversed."""

    def pull_messages(self, ids: list[str]) -> list[Any]:
        queries = [
            m.metadata.message_id
            for m in self.pending
            if m.metadata.message_id in ids and m.metadata.message_type == W.MESSAGE_TYPE
        ]
        return super().pull_messages(queries[-1:] or ids)


def grid_payload(cfg: dict[str, Any], **kw: Any) -> W.Payload:
    """The payload of a grid run: the test plugins imported, short waits, ``kw`` on top."""
    options = {"imports": ["helpers.flower"], "node_wait_s": 0, "timeout_s": 5, "poll_s": 0.01}
    options.update(kw.pop("options", {}))
    return W.Payload(config=cfg, options=options, **kw)


def flower_run(cfg: dict[str, Any], state_dir: Path, **kw: Any) -> dict[str, Any]:
    """Runs ``cfg`` on a grid (``FakeGrid`` unless ``grid_cls``); node states under
    ``state_dir``. Grid keywords: dead, crash_after, node_config, num_nodes, events, and
    num_partitions (the client count, where the config's partition does not say it)."""
    keys = ("dead", "crash_after", "node_config", "num_nodes", "events")
    grid_kw = {k: kw.pop(k) for k in keys if k in kw}
    grid_cls = kw.pop("grid_cls", FakeGrid)
    # A natural partition's client count is its groups' (``num_partitions``), not in cfg.
    clients = kw.pop("num_partitions", None) or cfg.get("partition", {}).get("num_clients")
    clients = clients or cfg["task"]["num_clients"]
    pay = grid_payload(cfg, **kw)
    n = grid_kw.pop("num_nodes", clients)
    grid = grid_cls(pay, n, state_dir, num_partitions=clients, **grid_kw)
    return S.server_main(grid, pay)


def embedded_run(cfg: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Runs ``cfg`` on the embedded runtime."""
    return run(load_config(cfg), progress=False, **kw)


def same_run(a: Path, b: Path) -> None:
    """The two run folders logged the same rounds, audit, failures and client metrics."""
    for log in ("metrics.jsonl", "audit.jsonl", "failures.jsonl", "client_metrics.jsonl"):
        assert untimed_rows(a / log) == untimed_rows(b / log), log
