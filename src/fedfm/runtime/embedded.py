"""The embedded runtime: every simulated client in the server's process.

Shared frozen models are loaded once (they live in the task); only per-client trainable
state is kept per client, in a :class:`~fedfm.core.state.ClientStateStore`. A handler runs
on a copy of its client's state, committed only when it returns a valid reply, so a client
that crashes mid-round leaves its state as it was.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from fedfm.algorithms.base import kinds_of
from fedfm.config import RunConfig
from fedfm.core.audit import AuditLedger
from fedfm.core.federation import (
    ClientContext,
    ClientInfo,
    ClientState,
    Federation,
    Handler,
    assign_roles,
    dispatch,
)
from fedfm.core.messages import Message, MessageKind, validate_arrays
from fedfm.core.state import ClientStateStore
from fedfm.engine import Engine, Setup
from fedfm.errors import ConfigError, FedfmError, MessageError

log = logging.getLogger("fedfm")


class EmbeddedFederation(Federation):
    """Runs client handlers in-process.

    Args:
        clients: Client ids and roles.
        seed: Run seed.
        handlers: Message kind -> client handler.
        kinds: Message kind -> declaration.
        task: The task (data and shared models).
        store: Client-state store.
        ledger: Audit ledger.
    """

    def __init__(
        self,
        clients: list[ClientInfo],
        seed: int,
        handlers: Mapping[str, Handler],
        kinds: Mapping[str, MessageKind],
        task: Any,
        store: ClientStateStore,
        ledger: AuditLedger,
    ) -> None:
        super().__init__(clients, seed)
        self.handlers = handlers
        self.kinds = kinds
        self.task = task
        self.store = store
        self.ledger = ledger
        self._roles = {c.cid: c.role for c in clients}

    def send(
        self,
        messages: Mapping[str, Message],
        like: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Message]:
        replies: dict[str, Message] = {}
        for cid, msg in messages.items():
            if cid not in self._roles:
                raise MessageError(f"no client with id '{cid}'")
            kind = self.kinds.get(msg.kind)
            if kind is None:
                raise MessageError(f"message kind '{msg.kind}' is not declared by the algorithm")
            kind.check(msg, "down")
            self.ledger.record(self.rnd, cid, "down", msg)
            reply = self._call(cid, msg, like)
            if reply is not None:
                replies[cid] = reply
        return replies

    def _call(
        self, cid: str, msg: Message, like: Mapping[str, Mapping[str, Tensor]] | None
    ) -> Message | None:
        saved = self.store.get(cid)
        # Handlers replace tensors rather than edit them in place, so a shallow copy of the
        # dict protects the stored state from a handler that fails halfway.
        state = ClientState(arrays=dict(saved.arrays), meta=copy.deepcopy(saved.meta))
        ctx = ClientContext(cid, self._roles[cid], self.rnd, self.seed, self.task, state)
        try:
            reply = dispatch(self.handlers, self.kinds, ctx, msg)
            for name, template in (like or {}).items():
                if name in reply.arrays:
                    validate_arrays(cid, name, reply.arrays[name], template)
        except Exception as e:  # a crashed client is logged and left out of the round
            self._fail(cid, msg.kind, e)
            return None
        self.ledger.record(self.rnd, cid, "up", reply)
        self.store.put(cid, state)
        return reply

    def _fail(self, cid: str, kind: str, err: Exception) -> None:
        reason = str(err) if isinstance(err, FedfmError) else f"{type(err).__name__}: {err}"
        self.failures.append({"round": self.rnd, "client": cid, "kind": kind, "error": reason})
        log.warning("round %d: client %s failed on '%s': %s", self.rnd, cid, kind, reason)


def embedded_federation(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
    """The engine's federation factory for the embedded runtime: every client in this process."""
    cfg = setup.cfg
    clients = assign_roles(setup.task.client_ids(), cfg.clients.roles, cfg.seed)
    return EmbeddedFederation(
        clients,
        cfg.seed,
        setup.algo.handlers(),
        kinds_of(type(setup.algo)),
        setup.task,
        store,
        ledger,
    )


def run_embedded(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs an experiment on the embedded runtime; returns the run summary.

    Raises:
        ConfigError: ``options`` are given (the embedded runtime has none).
    """
    if options:
        raise ConfigError("runtime", "the embedded runtime takes no runtime options")
    return Engine(cfg, embedded_federation, resume, overwrite, progress).run()
