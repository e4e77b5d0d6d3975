"""The federation interface that every algorithm speaks (DESIGN.md principle 3).

Shaped like Flower's Message API. The server half of an algorithm gets a
:class:`Federation` and calls :meth:`Federation.send` with one :class:`Message` per chosen
client, as often per round as it needs; the client half is a set of handlers, one per
message kind, each called as ``handler(ctx, msg) -> reply`` with a :class:`ClientContext`.
Runtimes (embedded, Flower) implement :class:`Federation`; algorithms are written once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from fedfm.core.audit import AuditLedger
from fedfm.core.codec import Wire
from fedfm.core.messages import (
    Message,
    MessageKind,
    array_bytes,
    meta_bytes,
    validate_reply,
)
from fedfm.core.seeding import derive_seed
from fedfm.core.settings import RunView
from fedfm.core.state import ClientState
from fedfm.errors import ConfigError, FedfmError, MessageError

log = logging.getLogger("fedfm")


class ClientTask(Protocol):
    """What the core needs of a task on a client: its data, batches, loss and evaluation.

    :class:`fedfm.tasks.base.Task` provides it; the core never imports the task layer.
    """

    @property
    def run(self) -> RunView:
        """The run config (the core reads ``run.rounds`` for learning-rate schedules)."""
        ...

    def client_data(self, cid: str) -> Any:
        """Training data of one client."""
        ...

    def client_test_data(self, cid: str) -> Any:
        """Held-out local data of one client."""
        ...

    def num_examples(self, data: Any) -> int:
        """Number of examples in ``data``."""
        ...

    def batches(self, data: Any, batch_size: int, seed: int) -> Iterator[Any]:
        """An endless iterator of shuffled batches."""
        ...

    def loss(self, model: Any, batch: Any) -> tuple[Tensor, Any]:
        """Task loss and model outputs for a batch."""
        ...

    def evaluate(self, model: Any, data: Any) -> dict[str, float]:
        """Metrics of ``model`` on ``data``."""
        ...

    def get_params(self, model: Any, names: list[str] | None = None) -> dict[str, Tensor]:
        """Detached CPU copies of the tensors of the task's ``model`` that travel."""
        ...

    def set_params(self, model: Any, params: Mapping[str, Tensor]) -> None:
        """Copies ``params`` (keyed as :meth:`get_params`) into ``model``."""
        ...

    def param_names(self, model: Any) -> dict[str, str]:
        """Key of each trainable tensor that travels -> its parameter name in ``model``."""
        ...


@dataclass
class ClientContext:
    """What a client handler sees.

    Attributes:
        cid: Client id.
        role: Client role (e.g. ``"default"``, ``"strong"``, ``"weak"``).
        rnd: Current round (0 for phases before the rounds).
        seed: Run seed; combine with :func:`derive_seed` for local randomness.
        task: The task: this client's data, shared frozen models, model builders.
        state: Persistent client state.
    """

    cid: str
    role: str
    rnd: int
    seed: int
    task: ClientTask
    state: ClientState

    @property
    def data(self) -> Any:
        """This client's local training data."""
        return self.task.client_data(self.cid)

    def rng_seed(self, purpose: str = "") -> int:
        """A seed unique to this client, round and purpose."""
        return derive_seed(self.seed, self.rnd, self.cid, purpose)


Handler = Callable[[ClientContext, Message], Message]


@dataclass(frozen=True)
class ClientInfo:
    """What the server knows of a client before talking to it."""

    cid: str
    role: str = "default"


def assign_roles(
    cids: list[str], roles: Mapping[str, float | Sequence[int | str]], seed: int
) -> list[ClientInfo]:
    """Gives each client a role: listed ids, then ``floor(fraction·N)`` clients per role, seeded.

    Every process of a run (the server, each Flower client) computes the same roles from the
    run seed. A role given as a list of client ids takes exactly those clients; a role given
    as a fraction takes ``floor(fraction·N)`` of the others in a seeded order. Clients not
    given a named role get ``"default"``.

    Args:
        cids: Client ids in their stable order.
        roles: Role name -> fraction of the clients, or the ids of its clients.
        seed: Run seed.

    Returns:
        One :class:`ClientInfo` per client, in the order of ``cids``.

    Raises:
        ConfigError: A listed id is not a client or is listed for two roles
            (``clients.roles.<role>``).
    """
    order = np.random.default_rng(derive_seed(seed, "roles")).permutation(len(cids)).tolist()
    role_of = {c: "default" for c in cids}
    listed: set[str] = set()
    for role, ids in sorted(roles.items()):
        if isinstance(ids, float | int):
            continue
        for c in map(str, ids):
            if c not in role_of or c in listed:
                why = "is not a client" if c not in role_of else "is listed for two roles"
                raise ConfigError(f"clients.roles.{role}", f"client id {c!r} {why}")
            role_of[c] = role
            listed.add(c)
    free = [i for i in order if cids[i] not in listed]
    start = 0
    for role, frac in sorted(roles.items()):
        if not isinstance(frac, float | int):
            continue
        k = math.floor(frac * len(cids))
        for i in free[start : start + k]:
            role_of[cids[i]] = role
        start += k
    return [ClientInfo(c, role_of[c]) for c in cids]


def dispatch(
    handlers: Mapping[str, Handler],
    kinds: Mapping[str, MessageKind],
    ctx: ClientContext,
    msg: Message,
) -> Message:
    """Runs one message through the client handler of its kind, checking both directions.

    Unknown kinds and kinds the client's role does not handle are refused. The global torch
    RNG is seeded from (run seed, round, client, kind) first, so dropout and any other
    implicit randomness is the same on every runtime and after resume. A kind declared
    ``no_grad`` runs under ``torch.inference_mode()`` (a ``backward()`` in its handler fails),
    and the tensors it returns or stores are made ordinary tensors afterwards.

    Args:
        handlers: Message kind -> client handler.
        kinds: Message kind -> declaration.
        ctx: The client's context.
        msg: The message from the server.

    Returns:
        The handler's reply.

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
    """Replaces the inference-mode tensors a no-grad handler made by ordinary copies.

    The server and later handlers may update them in place, which inference tensors refuse.
    """
    for arrays in [*reply.arrays.values(), state.arrays]:
        for key, value in arrays.items():
            if isinstance(value, Tensor) and value.is_inference():
                arrays[key] = value.clone()


Templates = Mapping[str, Mapping[str, Tensor]]
"""Expected reply tensors: array field -> tensor name -> a tensor of the expected shape/dtype."""


def message_bytes(msg: Message) -> int:
    """Bytes of a message's fields, counted as the audit ledger counts them."""
    arrays = sum(array_bytes(a) for a in msg.arrays.values())
    return arrays + sum(meta_bytes(v) for v in msg.meta.values())


class Undelivered(FedfmError):
    """A message that did not reach its client, or whose delivery nobody confirmed.

    A runtime yields it as the client's outcome. The audit ledger records only messages
    that reached their client, so an undelivered one is left out of it (and of
    ``bytes_down``); its row in ``failures.jsonl`` carries ``delivery`` (why) and
    ``bytes`` (what the message would have carried).

    Args:
        reason: The one line logged in ``failures.jsonl``.
        delivery: ``"not sent"`` (no way to the client) or ``"unconfirmed"`` (handed on,
            but the client never answered, so nothing shows that it arrived).
    """

    def __init__(self, reason: str, delivery: str) -> None:
        super().__init__(reason)
        self.delivery = delivery


def error_reason(err: BaseException) -> str:
    """A client failure as the one line logged in ``failures.jsonl`` on every runtime."""
    return str(err) if isinstance(err, FedfmError) else f"{type(err).__name__}: {err}"


def check_reply(
    kinds: Mapping[str, MessageKind],
    cid: str,
    sent: Message,
    reply: Message,
    like: Templates | None,
) -> None:
    """The server's checks of a reply that crossed a wire: never trust the client.

    Raises:
        MessageError: The reply's kind differs from the message's, or a field is undeclared.
        UpdateRejectedError: An array field does not match its template in ``like``.
    """
    if reply.kind != sent.kind:
        raise MessageError(f"client {cid}: reply of kind '{reply.kind}' to '{sent.kind}'")
    kinds[reply.kind].check(reply, "up")
    validate_reply(cid, reply, like)


@dataclass
class ClientRunner:
    """The client half of an algorithm in one process: the one client call path.

    Every runtime runs client messages through :meth:`call`: the embedded runtime for all
    clients in the server's process, a Flower ClientApp for the client its SuperNode serves.

    Attributes:
        handlers: Message kind -> client handler.
        kinds: Message kind -> declaration.
        roles: Client id -> role.
        task: The task (client data, shared frozen models).
        seed: Run seed.
    """

    handlers: Mapping[str, Handler]
    kinds: Mapping[str, MessageKind]
    roles: Mapping[str, str]
    task: ClientTask
    seed: int

    def call(
        self, cid: str, rnd: int, saved: ClientState, msg: Message, like: Templates | None = None
    ) -> tuple[Message, ClientState]:
        """Runs ``msg`` for client ``cid`` on a copy of its state.

        The caller commits the returned state only when this returns, so a client that fails
        (its handler raises, or its reply is refused) keeps the state it had.

        Args:
            cid: Client id.
            rnd: Current round.
            saved: The client's state (not modified).
            msg: The message from the server.
            like: Templates the reply's array fields must match (see :meth:`Federation.send`).

        Returns:
            The reply and the client's new state.

        Raises:
            Exception: Whatever the handler raised; MessageError or UpdateRejectedError for a
                refused message or reply.
        """
        state = saved.copy()
        ctx = ClientContext(cid, self.roles[cid], rnd, self.seed, self.task, state)
        reply = dispatch(self.handlers, self.kinds, ctx, msg)
        validate_reply(cid, reply, like)
        return reply, state


class Federation(ABC):
    """Server-side handle to the clients, implemented by each runtime.

    Runtimes implement :meth:`_exchange` only; checks of outgoing messages, the audit ledger,
    the failure log and the order of replies are the same for all of them.

    Args:
        clients: Every client, in a stable order.
        seed: Run seed.
        kinds: Message kind -> declaration; outgoing messages are checked against it (None:
            no checks).
        ledger: Audit ledger; an in-memory one when None.

    Attributes:
        seed: Run seed.
        rnd: Current round, set by the engine.
        clients: Every client, in a stable order.
        failures: One row per failed client (round, client, kind, error).
        wire: The codecs array fields travel in (``comm``): the receiver gets the decoded
            tensors and the ledger counts the encoded bytes.
        codes_on_wire: The runtime's transport encodes and decodes itself (Flower), so the
            federation only counts the bytes.
    """

    codes_on_wire = False

    def __init__(
        self,
        clients: Sequence[ClientInfo],
        seed: int,
        kinds: Mapping[str, MessageKind] | None = None,
        ledger: AuditLedger | None = None,
    ) -> None:
        self.clients = list(clients)
        self.seed = seed
        self.kinds = kinds
        self.ledger = ledger if ledger is not None else AuditLedger()
        self.ledger.declare(kinds)  # it marks which fields of DP kinds are DP outputs
        self.rnd = 0
        self.failures: list[dict[str, Any]] = []
        self._roles = {c.cid: c.role for c in self.clients}
        self.wire = Wire()  # the run's codecs (``comm``); the engine sets them

    def client_ids(self, role: str | None = None) -> list[str]:
        """Ids of all clients, or of those with ``role``."""
        return [c.cid for c in self.clients if role is None or c.role == role]

    def role_of(self, cid: str) -> str:
        """The role of client ``cid``."""
        return self._roles[cid]

    def sample(self, fraction: float, role: str | None = None, min_clients: int = 1) -> list[str]:
        """Samples clients for this round, seeded by (run seed, round, role).

        Args:
            fraction: Fraction of the eligible clients, in (0, 1].
            role: Only clients with this role, or all.
            min_clients: At least this many (capped by the number eligible).

        Returns:
            Sorted client ids.
        """
        pool = self.client_ids(role)
        k = min(len(pool), max(min_clients, round(fraction * len(pool))))
        if k >= len(pool):
            return pool
        rng = np.random.default_rng(derive_seed(self.seed, self.rnd, "sample", role or "*"))
        idx = sorted(rng.choice(len(pool), size=k, replace=False).tolist())
        return [pool[i] for i in idx]

    def stream(
        self, messages: Mapping[str, Message], like: Templates | None = None
    ) -> Iterator[tuple[str, Message]]:
        """Sends one message to each client and yields the replies one at a time.

        Replies come in the order of ``messages`` on every runtime, so an algorithm that
        folds them into a running sum gets the same numbers everywhere, and holds one reply
        at a time rather than all of them. A client whose handler raises, who does not
        answer, or whose reply fails validation is logged in :attr:`failures` and skipped.
        Consume the iterator to the end: clients after the point where it is left are never
        asked.

        Args:
            messages: Client id -> message.
            like: Optional templates, array field -> expected tensors; a reply's array field
                named here must have exactly these keys, shapes and dtypes and be finite.

        Yields:
            ``(client id, reply)`` for the clients that answered validly.

        Raises:
            MessageError: A message is for an unknown client or carries an undeclared kind or
                field (raised at once, before anything is sent).
        """
        messages = dict(messages)
        for cid, msg in messages.items():
            self._check_outgoing(cid, msg)
        return self._replies(messages, like)

    def _code_down(
        self, messages: dict[str, Message]
    ) -> tuple[dict[str, Message], dict[str, dict[str, tuple[str, int]]]]:
        """The messages as clients decode them from the wire's codecs, and the bytes sent.

        One message sent to many clients is encoded once. A runtime whose transport encodes
        (:attr:`codes_on_wire`) gets the messages unchanged and the sizes alone.
        """
        out, sizes = dict(messages), {}
        done: dict[int, tuple[Message, dict[str, tuple[str, int]]]] = {}
        for cid, msg in messages.items():
            if id(msg) not in done:
                done[id(msg)] = self.wire.round_trip(msg, "down")
            coded, sizes[cid] = done[id(msg)]
            if not self.codes_on_wire:
                out[cid] = coded
        return out, sizes

    def send(
        self, messages: Mapping[str, Message], like: Templates | None = None
    ) -> dict[str, Message]:
        """Sends one message to each client and gathers all replies (see :meth:`stream`).

        Returns:
            Client id -> reply, for the clients that answered validly.
        """
        return dict(self.stream(messages, like))

    def broadcast(
        self, msg: Message, cids: Sequence[str], like: Templates | None = None
    ) -> dict[str, Message]:
        """Sends the same message to several clients (see :meth:`send`)."""
        return self.send({cid: msg for cid in cids}, like=like)

    def _check_outgoing(self, cid: str, msg: Message) -> None:
        if cid not in self._roles:
            raise MessageError(f"no client with id '{cid}'")
        if self.kinds is None:
            return
        kind = self.kinds.get(msg.kind)
        if kind is None:
            raise MessageError(f"message kind '{msg.kind}' is not declared by the algorithm")
        kind.check(msg, "down")

    def _replies(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message]]:
        # Per client: downlink, then uplink, in the order of the messages, on every runtime.
        sent, down_sizes = self._code_down(messages) if self.wire.active else (messages, {})
        for cid, outcome in self._exchange(sent, like):
            msg = messages[cid]
            if isinstance(outcome, Undelivered):
                self._fail(cid, msg.kind, outcome)
                self.failures[-1].update(delivery=outcome.delivery, bytes=message_bytes(msg))
                continue
            self.ledger.record(self.rnd, cid, "down", msg, down_sizes.get(cid))
            if isinstance(outcome, BaseException):
                self._fail(cid, msg.kind, outcome)
                continue
            up_sizes: dict[str, tuple[str, int]] = {}
            if self.wire.active:
                coded, up_sizes = self.wire.round_trip(outcome, "up")
                outcome = outcome if self.codes_on_wire else coded
            self.ledger.record(self.rnd, cid, "up", outcome, up_sizes)
            yield cid, outcome

    def _fail(self, cid: str, kind: str, err: BaseException) -> None:
        reason = error_reason(err)
        self.failures.append({"round": self.rnd, "client": cid, "kind": kind, "error": reason})
        log.warning("round %d: client %s failed on '%s': %s", self.rnd, cid, kind, reason)

    @abstractmethod
    def _exchange(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message | Exception]]:
        """Delivers the messages and yields each client's outcome in the order of ``messages``.

        An outcome is the client's reply, already checked (declared fields, ``like``), or the
        exception that failed the client. Messages are already checked against their kinds.
        """
