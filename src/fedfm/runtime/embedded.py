"""The embedded runtime: every simulated client in the server's process.

Shared frozen models are loaded once (they live in the task); only per-client trainable
state is kept per client, in a :class:`~fedfm.core.state.ClientStateStore`. A handler runs
on a copy of its client's state, committed only when it returns a valid reply, so a client
that crashes mid-round leaves its state as it was.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fedfm.core.audit import AuditLedger
from fedfm.core.federation import (
    ClientContext,
    ClientInfo,
    ClientState,
    Federation,
    Handler,
    derive_seed,
)
from fedfm.core.messages import Message, MessageKind, validate_reply
from fedfm.core.state import ClientStateStore
from fedfm.errors import FedfmError, MessageError

log = logging.getLogger("fedfm")


def dispatch(
    handlers: Mapping[str, Handler],
    kinds: Mapping[str, MessageKind],
    ctx: ClientContext,
    msg: Message,
) -> Message:
    """Client-side dispatch shared by the runtimes: refuse unknown kinds, check both ways.

    The global torch RNG is seeded from (run seed, round, client, kind) first, so dropout and
    any other implicit randomness is the same on every runtime and after resume. A kind
    declared ``no_grad`` runs under ``torch.inference_mode()`` (a ``backward()`` in its handler
    fails), and the tensors it returns or stores are made ordinary tensors afterwards.

    Raises:
        MessageError: The kind is unknown, not for this client's role, or a field is undeclared.
    """
    kind = kinds.get(msg.kind)
    if kind is None or msg.kind not in handlers:
        raise MessageError(f"client {ctx.cid}: unknown message kind '{msg.kind}'")
    if kind.roles and ctx.role not in kind.roles:
        raise MessageError(
            f"client {ctx.cid}: role '{ctx.role}' does not handle message kind '{msg.kind}'"
        )
    kind.check(msg, "down")
    # The default generator directly: torch.manual_seed also records CUDA seeding state,
    # which costs milliseconds per call on a CPU-only build.
    torch.default_generator.manual_seed(derive_seed(ctx.seed, ctx.rnd, ctx.cid, msg.kind))
    with torch.inference_mode() if kind.no_grad else contextlib.nullcontext():
        reply = handlers[msg.kind](ctx, msg)
    if kind.no_grad:
        _plain_tensors(reply, ctx.state)
    kind.check(reply, "up")
    return reply


def _plain_tensors(reply: Message, state: ClientState) -> None:
    """Replaces inference-mode tensors of a no-grad handler by ordinary copies: the server and
    later handlers may update them in place, which inference tensors refuse."""
    for arrays in [*reply.arrays.values(), state.arrays]:
        for key, value in arrays.items():
            if isinstance(value, Tensor) and value.is_inference():
                arrays[key] = value.clone()


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
            validate_reply(cid, reply, like)
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
