"""The federation interface that every algorithm speaks (DESIGN.md principle 3).

Shaped like Flower's Message API. The server half of an algorithm gets a
:class:`Federation` and calls :meth:`Federation.send` with one :class:`Message` per chosen
client, as often per round as it needs; the client half is a set of handlers, one per
message kind, each called as ``handler(ctx, msg) -> reply`` with a :class:`ClientContext`.
Runtimes (embedded, Flower) implement :class:`Federation`; algorithms are written once.
"""

from __future__ import annotations

import copy
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from fedfm.core.messages import Arrays, Message, MessageKind
from fedfm.errors import MessageError

if TYPE_CHECKING:
    from fedfm.tasks.base import Task


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (run seed, round, client id, purpose).

    Randomness in fedfm is derived from such seeds rather than from global RNG state, so a
    resumed run and a run on another runtime draw the same numbers.
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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
        p = prefix + "/"
        return {k[len(p) :]: v for k, v in self.arrays.items() if k.startswith(p)}

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
    task: Task
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


def assign_roles(cids: list[str], roles: Mapping[str, float], seed: int) -> list[ClientInfo]:
    """Gives each client a role: ``floor(fraction·N)`` clients per named role, seeded.

    Every process of a run (the server, each Flower client) computes the same roles from the
    run seed. Clients not given a named role get ``"default"``.

    Args:
        cids: Client ids in their stable order.
        roles: Role name -> fraction of the clients.
        seed: Run seed.

    Returns:
        One :class:`ClientInfo` per client, in the order of ``cids``.
    """
    order = np.random.default_rng(derive_seed(seed, "roles")).permutation(len(cids)).tolist()
    role_of = {c: "default" for c in cids}
    start = 0
    for role, frac in sorted(roles.items()):
        k = math.floor(frac * len(cids))
        for i in order[start : start + k]:
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
    implicit randomness is the same on every runtime and after resume.

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
    reply = handlers[msg.kind](ctx, msg)
    kind.check(reply, "up")
    return reply


class Federation(ABC):
    """Server-side handle to the clients, implemented by each runtime.

    Attributes:
        seed: Run seed.
        rnd: Current round, set by the engine.
        clients: Every client, in a stable order.
    """

    def __init__(self, clients: Sequence[ClientInfo], seed: int) -> None:
        self.clients = list(clients)
        self.seed = seed
        self.rnd = 0
        self.failures: list[dict[str, Any]] = []

    def client_ids(self, role: str | None = None) -> list[str]:
        """Ids of all clients, or of those with ``role``."""
        return [c.cid for c in self.clients if role is None or c.role == role]

    def role_of(self, cid: str) -> str:
        """The role of client ``cid``."""
        for c in self.clients:
            if c.cid == cid:
                return c.role
        raise KeyError(cid)

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

    @abstractmethod
    def send(
        self,
        messages: Mapping[str, Message],
        like: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Message]:
        """Sends one message to each client and gathers the replies.

        A client whose handler raises, who does not answer, or whose reply fails validation
        is logged in :attr:`failures` and left out of the result.

        Args:
            messages: Client id -> message.
            like: Optional templates, array field -> expected tensors; a reply's array field
                named here must have exactly these keys, shapes and dtypes and be finite.

        Returns:
            Client id -> reply, for the clients that answered validly.
        """

    def broadcast(
        self,
        msg: Message,
        cids: Sequence[str],
        like: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Message]:
        """Sends the same message to several clients (see :meth:`send`)."""
        return self.send({cid: msg for cid in cids}, like=like)
