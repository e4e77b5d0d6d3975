"""A federation whose clients answer with canned or function-made replies.

It lets a test run an algorithm's server half alone, without the engine, a runtime or any
client code, and check what the server sent and what it made of the replies by hand::

    fed = FakeFederation(["0", "1"], lambda cid, msg: Message("train", {...}, {...}),
                         kinds=algo.messages)
    metrics = algo.round(fed)

Everything else behaves as on a real runtime: messages are checked against the declared
kinds, replies against their kind and the ``like`` templates, a client whose reply function
raises (or that has no canned reply) is a failed client logged in ``failures``, replies come
in the order of the messages, and the audit ledger (in memory) records every field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from fedfm.core.federation import ClientInfo, Federation, Templates, check_reply
from fedfm.core.messages import Message, MessageKind, validate_reply
from fedfm.errors import FedfmError

ReplyFn = Callable[[str, Message], Message]


class NoReply(FedfmError):
    """A client of a :class:`FakeFederation` has no canned reply to a message."""


class FakeFederation(Federation):
    """A :class:`~fedfm.core.federation.Federation` for testing a server half alone.

    Args:
        clients: Client ids (role ``"default"``) or :class:`ClientInfo` with roles.
        replies: How clients answer: a function ``(client id, message) -> reply`` (raise in
            it to make the client fail), or canned replies by client id (or by
            ``(client id, kind)`` for several kinds).
        seed: Run seed (client sampling draws from it).
        rnd: The current round.
        kinds: The algorithm's message kinds (e.g. ``algo.messages``); messages and replies
            are checked against them as on a real runtime. None: unchecked.

    Attributes:
        sent: Every ``(round, client id, message)`` sent, in order.
    """

    def __init__(
        self,
        clients: Sequence[str | ClientInfo],
        replies: ReplyFn | Mapping[str, Message] | Mapping[tuple[str, str], Message],
        seed: int = 0,
        rnd: int = 1,
        kinds: Iterable[MessageKind] | None = None,
    ) -> None:
        infos = [c if isinstance(c, ClientInfo) else ClientInfo(c) for c in clients]
        declared = None if kinds is None else {k.name: k for k in kinds}
        super().__init__(infos, seed, declared)
        self.rnd = rnd
        self.replies = replies
        self.sent: list[tuple[int, str, Message]] = []

    def _answer(self, cid: str, msg: Message) -> Message:
        if callable(self.replies):
            return self.replies(cid, msg)
        canned: Mapping[Any, Message] = self.replies
        for key in ((cid, msg.kind), cid):
            if key in canned:
                return canned[key]
        raise NoReply(f"client {cid}: no canned reply to '{msg.kind}'")

    def _exchange(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message | Exception]]:
        for cid, msg in messages.items():
            self.sent.append((self.rnd, cid, msg))
            try:
                reply = self._answer(cid, msg)
                if self.kinds is not None:
                    check_reply(self.kinds, cid, msg, reply, like)
                else:
                    validate_reply(cid, reply, like)
            except Exception as e:  # a failed client is logged and left out, as on a runtime
                yield cid, e
                continue
            yield cid, reply
