"""The server side of the Flower runtime: the federation over Flower's grid, the server session.

The server half of an algorithm runs inside Flower's ``ServerApp`` through the fedfm
:class:`~fedfm.engine.Engine` (so rounds, logs, checkpoints, resume and the audit ledger are
the engine's own); :class:`FlowerFederation` carries its messages over Flower's ``Grid``.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm.core.audit import AuditLedger
from fedfm.core.checkpoint import latest_checkpoint
from fedfm.core.federation import ClientInfo, Federation, Templates, Undelivered, check_reply
from fedfm.core.messages import Message, MessageKind
from fedfm.core.state import ClientStateStore
from fedfm.engine import Engine, FederationFactory, Setup
from fedfm.errors import FedfmError
from fedfm.runtime.flower.options import FlowerOptions
from fedfm.runtime.flower.pacing import pinned, quick_object_pulls
from fedfm.runtime.flower.payload import SESSIONS_FILE
from fedfm.runtime.flower.wire import (
    CLIENT_ERROR_CODE,
    HEADER,
    HELLO_TYPE,
    MESSAGE_TYPE,
    Payload,
    like_spec,
    message_to_records,
    records_to_message,
)

if TYPE_CHECKING:
    from flwr.serverapp import Grid

log = logging.getLogger("fedfm")

# Flower errors the SuperLink writes itself when a message's SuperNode went away
# (MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE in flwr 1.42): nothing shows the node received it.
# Other codes come from the SuperNode's side (the ClientApp failed or crashed there).
UNCONFIRMED_CODES = frozenset({3, 5})

#: The first pause between two pulls for replies (seconds); it doubles up to ``poll_s``.
FIRST_POLL_S = 0.01


def run_sessions(run_dir: Path, resumed_from: int) -> dict[str, Any]:
    """Records a new server session of a run and returns the run's session history.

    Client states live on the clients, one snapshot per (session, round). When a run
    resumes from the checkpoint of round ``k``, snapshots written after round ``k`` by the
    interrupted session are stale; the history tells clients which snapshots are valid: a
    snapshot of session ``s`` and round ``r`` is valid when ``r`` is at most the round from
    which the next session resumed.

    Args:
        run_dir: The run folder.
        resumed_from: Round of the checkpoint this session resumed from, or -1 for a fresh
            start (a new run identity).

    Returns:
        ``{"run_uid", "session", "lineage": [[session, last valid round], ...]}``.
    """
    path = run_dir / SESSIONS_FILE
    data = json.loads(path.read_text()) if resumed_from >= 0 and path.exists() else None
    if data is None:
        if resumed_from >= 0:
            log.warning(
                "%s has no Flower session history: clients start from empty states", run_dir
            )
        data = {"run_uid": uuid.uuid4().hex, "sessions": []}
    data["sessions"].append({"session": len(data["sessions"]), "resumed_from": resumed_from})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    sessions = data["sessions"]
    lineage = [[s["session"], nxt["resumed_from"]] for s, nxt in itertools.pairwise(sessions)]
    return {"run_uid": data["run_uid"], "session": sessions[-1]["session"], "lineage": lineage}


class FlowerFederation(Federation):
    """The federation interface over a Flower ``Grid`` (server side).

    Each exchange pushes one Flower message per client and polls for the replies until all
    have arrived or ``timeout_s`` has passed. Replies are handed on in the order of the
    messages, each as soon as it and those before it are in: one that comes early waits
    (still encoded) for those before it, and is decoded only when its turn comes. Replies
    are checked as on the embedded runtime (declared fields, ``like`` templates); an error
    reply, a missing reply or an invalid one is logged in :attr:`failures` and left out.

    Args:
        clients: Client ids and roles.
        seed: Run seed.
        grid: The ServerApp's grid.
        kinds: Message kind -> declaration.
        ledger: Audit ledger.
        session: Run identity and session history (:func:`run_sessions`).
        options: Flower options.
    """

    codes_on_wire = True  # coded fields travel encoded (wire.py); the base counts bytes

    def __init__(
        self,
        clients: list[ClientInfo],
        seed: int,
        grid: Grid,
        kinds: Mapping[str, MessageKind],
        ledger: AuditLedger,
        session: Mapping[str, Any],
        options: FlowerOptions,
    ) -> None:
        super().__init__(clients, seed, kinds, ledger)
        self.kinds: Mapping[str, MessageKind] = kinds
        self.grid = grid
        self.session = dict(session)
        self.options = options
        self.node_of: dict[str, int] = {}
        self.connected: set[str] = set()  # clients a SuperNode has served at some point
        self.answered: set[str] = set()  # clients whose SuperNode answered a message
        self._said_hello: set[int] = set()
        self._hello_pending: dict[str, int] = {}  # handshake message id -> node
        self.wait_for_nodes()

    # ----- nodes -----
    def wait_for_nodes(self) -> None:
        """Maps SuperNodes to client ids, waiting up to ``node_wait_s`` for all of them."""
        deadline = time.monotonic() + self.options.node_wait_s
        sleep = 0.01
        while True:
            self.discover()
            if len(self.node_of) == len(self._roles) or time.monotonic() >= deadline:
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.5)
        missing = [c for c in self._roles if c not in self.node_of]
        if missing:
            log.warning(
                "no SuperNode serves client(s) %s after %.0f s: they count as failed",
                ", ".join(missing),
                self.options.node_wait_s,
            )

    def discover(self) -> None:
        """Keeps the SuperNode -> client map current, without blocking.

        Nodes the SuperLink no longer lists as online are forgotten (their clients fail
        at once instead of waiting for a timeout); a node seen for the first time, or back
        online, gets a handshake asking which client it serves; replies to earlier
        handshakes are collected. Called before every exchange, so a SuperNode that
        restarts mid-run serves its client again from the next exchange on.
        """
        from flwr.app import ConfigRecord, RecordDict
        from flwr.app import Message as FlowerMessage

        alive = {int(n) for n in self.grid.get_node_ids()}
        self.node_of = {c: n for c, n in self.node_of.items() if n in alive}
        self._said_hello &= alive
        self._hello_pending = {m: n for m, n in self._hello_pending.items() if n in alive}
        asking = set(self._hello_pending.values())
        new = sorted(n for n in alive if n not in self._said_hello and n not in asking)
        if new:
            head = json.dumps(self.session)
            msgs = [
                FlowerMessage(
                    RecordDict({HEADER: ConfigRecord({"header": head})}),
                    n,
                    HELLO_TYPE,
                    group_id="hello",
                )
                for n in new
            ]
            pushed = {str(i) for i in self.grid.push_messages(msgs) if i}
            for m, n in zip(msgs, new, strict=True):
                if str(m.metadata.message_id) in pushed:
                    self._hello_pending[str(m.metadata.message_id)] = n
        if not self._hello_pending:
            return
        for reply in self.grid.pull_messages(list(self._hello_pending)):
            rid = reply.metadata.reply_to_message_id
            if rid in self._hello_pending:
                n = self._hello_pending.pop(rid)
                self._said_hello.add(n)
                self._map(n, reply)

    def _map(self, node: int, reply: Any) -> None:
        if reply.has_error():
            log.warning("SuperNode %d refused the handshake: %s", node, reply.error.reason)
            return
        cid = str(json.loads(str(reply.content[HEADER]["header"]))["cid"])
        if cid not in self._roles:
            log.warning("SuperNode %d serves unknown client '%s': ignored", node, cid)
        elif cid in self.node_of and self.node_of[cid] != node:
            log.warning(
                "SuperNodes %d and %d both serve client %s: keeping %d",
                self.node_of[cid],
                node,
                cid,
                self.node_of[cid],
            )
        else:
            self.node_of[cid] = node
            self.connected.add(cid)

    # ----- exchanges -----
    def _exchange(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message | Exception]]:
        from flwr.app import Message as FlowerMessage

        self.discover()
        flower_msgs = {
            cid: FlowerMessage(
                message_to_records(msg, self._header(cid, like), self.wire, "down"),
                self.node_of[cid],
                MESSAGE_TYPE,
                group_id=str(self.rnd),
            )
            for cid, msg in messages.items()
            if cid in self.node_of
        }
        # One push per message: Flower shows a message to its SuperNode as soon as it is
        # pushed and uploads the objects after, so a node that sees its message while the
        # objects of all messages are still being uploaded retries each object pull.
        pushed = {str(i) for m in flower_msgs.values() for i in self.grid.push_messages([m]) if i}
        id_of = {c: str(m.metadata.message_id) for c, m in flower_msgs.items()}
        inbox = _Inbox(self.grid, {i for i in id_of.values() if i in pushed}, self.options)
        for cid, msg in messages.items():
            if cid not in id_of:
                yield cid, ClientLost(f"client {cid}: no SuperNode serves this client", "not sent")
                continue
            if id_of[cid] not in pushed:
                why = f"client {cid}: the SuperLink did not accept the message"
                yield cid, ClientLost(why, "not sent")
                continue
            raw = inbox.take(id_of[cid])
            if raw is None:
                waited = inbox.waited()
                why = f"client {cid}: no reply within {waited:.0f} s (SuperNode lost?)"
                yield cid, ClientLost(why, "unconfirmed")
                continue
            if raw.has_error() and raw.error.code in UNCONFIRMED_CODES:
                why = f"client {cid}: Flower error {raw.error.code}: {raw.error.reason}"
                yield cid, ClientLost(why, "unconfirmed")
                continue
            self.answered.add(cid)
            try:
                yield cid, self._decode(cid, msg, raw, like)
            except Exception as e:  # a failed client is logged and left out of the round
                yield cid, e

    def absent(self) -> dict[str, str]:
        """Clients that took no part in this session (no message of theirs answered), with why.

        Client id -> ``"never connected"`` or ``"connected, never answered"``.
        """
        return {
            c: "connected, never answered" if c in self.connected else "never connected"
            for c in self._roles
            if c not in self.answered
        }

    def _header(self, cid: str, like: Templates | None) -> dict:
        return {
            **self.session,
            "cid": cid,
            "round": self.rnd,
            # The engine checkpoints after every round: rounds before this one are final.
            "committed": self.rnd - 1,
            "like": like_spec(like),
            # The run's codecs: the client decodes with them and encodes its reply.
            **({"comm": self.wire.spec()} if self.wire.active else {}),
        }

    def _decode(self, cid: str, sent: Message, raw: Any, like: Templates | None) -> Message:
        if raw.has_error():
            err = raw.error
            if err.code == CLIENT_ERROR_CODE:
                raise ClientFailed(err.reason or "")
            raise ClientFailed(f"client {cid}: Flower error {err.code}: {err.reason}")
        reply, _ = records_to_message(raw.content)
        check_reply(self.kinds, cid, sent, reply, like)
        return reply


class _Inbox:
    """Replies of one exchange, pulled from the grid as they come in.

    Flower's own ``send_and_receive`` sleeps 3 s between two pulls; this one pulls at once,
    then waits from :data:`FIRST_POLL_S`, doubling up to ``poll_s``, and starts again from
    :data:`FIRST_POLL_S` whenever a reply came in (the others often follow close behind).
    The wait for all replies of an exchange ends ``timeout_s`` after the messages were
    pushed.

    Args:
        grid: The ServerApp's grid (its ``pull_messages``).
        pending: Ids of the pushed messages whose replies are awaited.
        options: Flower options (``timeout_s``, ``poll_s``).
        clock: Monotonic clock (seconds).
        sleep: Sleeps for the given seconds.
    """

    def __init__(
        self,
        grid: Grid,
        pending: set[str],
        options: FlowerOptions,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid = grid
        self.pending = pending
        self.got: dict[str, Any] = {}
        self._clock = clock
        self._sleep = sleep
        self.start = clock()
        self.deadline = self.start + options.timeout_s
        self.poll_s = options.poll_s
        self._pause = FIRST_POLL_S

    def waited(self) -> float:
        """Seconds since the messages were pushed."""
        return self._clock() - self.start

    def take(self, message_id: str) -> Any:
        """The reply to ``message_id`` (removed from the inbox), or None if none came in time.

        Replies to other messages that arrive meanwhile stay in the inbox, still encoded.
        """
        while message_id not in self.got and message_id in self.pending:
            self._pull()
            if message_id in self.got or self._clock() >= self.deadline:
                break
            self._sleep(min(self._pause, max(self.deadline - self._clock(), 0.0)))
            self._pause = min(self._pause * 2, self.poll_s)
        return self.got.pop(message_id, None)

    def _pull(self) -> None:
        for reply in self.grid.pull_messages(list(self.pending)):
            rid = reply.metadata.reply_to_message_id
            if rid in self.pending:
                self.got[rid] = reply
                self.pending.discard(rid)
                self._pause = FIRST_POLL_S


class ClientFailed(FedfmError):
    """A client's handler failed (the reason is the client's own one-line error)."""


class ClientLost(Undelivered):
    """A client did not answer: no SuperNode serves it, or it died mid-exchange."""


def flower_federation_factory(grid: Grid, payload: Payload) -> FederationFactory:
    """An engine federation factory that talks to the clients over ``grid``."""

    def make(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
        cfg = setup.cfg
        run_dir = Path(cfg.out_dir) / cfg.name
        resumed_from = -1
        ck = latest_checkpoint(run_dir / "checkpoints") if payload.resume else None
        if ck is not None:
            resumed_from = int(json.loads((ck / "meta.json").read_text())["round"])
        session = run_sessions(run_dir, resumed_from)
        return FlowerFederation(
            setup.clients(), cfg.seed, grid, setup.kinds(), ledger, session, payload.flower()
        )

    return make


def server_main(grid: Grid, payload: Payload) -> dict[str, Any]:
    """The ServerApp's body: runs the fedfm engine with clients behind ``grid``.

    Returns:
        The run summary.
    """
    cfg = payload.run_config()
    if _deployed(grid) and pinned():
        quick_object_pulls()  # replies are pulled as soon as they show: see pacing
    made: list[FlowerFederation] = []
    make = flower_federation_factory(grid, payload)

    def federation(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
        fed = make(setup, store, ledger)
        assert isinstance(fed, FlowerFederation)
        made.append(fed)
        return fed

    engine = Engine(
        cfg,
        resume=payload.resume,
        overwrite=payload.overwrite,
        federation=federation,
        progress=payload.progress,
        started_at=payload.started_at,
    )
    try:
        return engine.run()
    finally:
        if made:  # also when the run failed: who was missing is often why
            report_absent(Path(cfg.out_dir) / cfg.name, made[0].absent())


def _deployed(grid: Grid) -> bool:
    """Whether ``grid`` is the deployment engine's (it pulls messages' objects over HTTP)."""
    from flwr.superlink.grid.http_grid import HttpGrid

    return isinstance(grid, HttpGrid)


def report_absent(run_dir: Path, absent: Mapping[str, str]) -> None:
    """Logs and records the clients that took no part in this session.

    Logs the clients that took no part in this session and records them in the session
    history (``flower_sessions.json``, key ``absent`` of the session).
    """
    if absent:
        log.warning(
            "clients that took no part in this session: %s",
            ", ".join(f"{c} ({why})" for c, why in absent.items()),
        )
    path = run_dir / SESSIONS_FILE
    if not path.exists():
        return
    data = json.loads(path.read_text())
    data["sessions"][-1]["absent"] = dict(absent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
