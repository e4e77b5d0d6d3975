"""Shorter waits for Flower's deployment engine: the SuperNode's polls and object pulls.

Flower 1.42 waits in three places that fedfm cannot set through any option, node-config
key or environment variable (the values are literals or bound defaults in its code):

- **The SuperNode's loop** (``flwr.supernode.start_client_internal``) asks the SuperLink for
  a message and, when none is waiting, sleeps 3 s before it asks again; once a message is
  in, it looks every 0.5 s whether its ClientApp has replied (and whether the reply's
  objects are in its store). Each exchange therefore waited 1.5 s on average (up to 3 s;
  the last of ten nodes nearly 3 s) before a node saw its message.
- **Object pulls** (``flwr.supercore.inflatable.inflatable_utils.pull_objects``): a message
  becomes visible before all of its objects (records, arrays) are uploaded, and a pull of
  an object that is not there yet retries after 1 s, then 2, 4, up to 10 s. The SuperNode
  pulling the server's message, the ClientApp pulling its task from the SuperNode and the
  ServerApp pulling a reply all hit this when they look early, which short polls make
  likely: a 1 s stall on a message of a few kilobytes.
- The SuperNode's heartbeat (``HEARTBEAT_DEFAULT_INTERVAL``, 30 s) is fixed too, but only
  tells the SuperLink the node is alive; it delays no message.

:func:`pace` replaces the loop's pauses in a SuperNode process: after an empty poll the
node waits :data:`IDLE_FRACTION` of the time since it last replied, at least
:data:`MIN_PAUSE_S` and :data:`POLL_COST_FACTOR` times as long as that poll took (a busy
SuperLink answers slowly, and its nodes then ask it less often), and at most Flower's
3 s. Right after a reply, while the server gathers the other replies and aggregates, a
node asks every 50 ms, so a message waits at most about 5 % of the node's idle time; a
node idle for a minute or more asks every 3 s as Flower's does, so an idle deployment
loads the SuperLink no more. The local waits for the reply become :data:`LOCAL_POLL_S`.
:func:`quick_object_pulls` makes object pulls retry after :data:`FIRST_OBJECT_RETRY_S`,
doubling up to :data:`OBJECT_RETRY_CAP_S` (Flower gives up on an object after 500 tries:
with this cap that is still over 15 minutes, more than the server's ``timeout_s``).

A fourth wait is fedfm's own: the warm worker (:mod:`fedfm.runtime.flower_app.worker`)
asks its SuperNode's runtime API for a task, and a task shows there before the node has
pulled the message's objects from the SuperLink. Polled every 50 ms, that is 20 requests a
second per node while idle, and the worker's first pulls of the objects find them missing.
With ``--wake-port PORT`` the paced SuperNode sends one datagram to the worker on
127.0.0.1:PORT (:class:`Wake`) once a message and all its objects are stored; the worker
waits for it (:class:`WakeListener`) and asks only then, or after
:data:`WAKE_FALLBACK_S` without one (it listens before its first ask, so no wake is lost).

Both apply only on the Flower version they were read from (the pinned one); on another
one Flower's waits stay as they are, with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import select
import socket
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("fedfm")

#: The Flower version whose waits these are.
FLOWER_VERSION = "1.42.0"
#: Flower's pause after a poll of the SuperLink that found no message (seconds).
FLOWER_IDLE_S = 3.0
#: Pause after an empty poll, as a fraction of the time since the node last replied.
IDLE_FRACTION = 0.05
#: Shortest pause after an empty poll (seconds): at most 20 polls a second per node.
MIN_PAUSE_S = 0.05
#: A pause after an empty poll lasts at least this many times the poll's round trip: a
#: node keeps the SuperLink answering its polls at most a tenth of the time.
POLL_COST_FACTOR = 10.0
#: Pause between two looks for the ClientApp's reply in the node's own state (seconds).
LOCAL_POLL_S = 0.01
#: First retry of an object pull that found the object not uploaded yet (seconds).
FIRST_OBJECT_RETRY_S = 0.02
#: Longest pause between two retries of an object pull (seconds).
OBJECT_RETRY_CAP_S = 2.0
#: How long a woken worker waits without a wake before it asks for a task anyway (seconds).
#: No wake is lost on loopback (the worker listens before its first ask); a sooner ask
#: would often find a task whose objects the node is still pulling (every pull retried).
WAKE_FALLBACK_S = 30.0
_LOOPBACK = "127.0.0.1"


def idle_pause(idle_s: float) -> float:
    """Seconds to wait after an empty poll, ``idle_s`` seconds after the node last replied."""
    return min(FLOWER_IDLE_S, max(MIN_PAUSE_S, IDLE_FRACTION * idle_s))


class PacedTime:
    """Stands in for the ``time`` module inside Flower's SuperNode loop.

    Every function is :mod:`time`'s own except :meth:`sleep`, which maps Flower's pauses to
    paced ones: its idle pause (:data:`FLOWER_IDLE_S`) to :func:`idle_pause`, or to
    :data:`POLL_COST_FACTOR` times the last empty poll's round trip when that is longer
    (never past Flower's pause), its shorter local waits to at most :data:`LOCAL_POLL_S`.

    Args:
        clock: Monotonic clock (seconds).
        sleep: The real sleep.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self.last_reply = clock()  # a node that just started is about to be greeted
        self.poll_s = 0.0  # round trip of the last poll that found no message

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def replied(self) -> None:
        """Marks the moment the node finished handling a message (its reply left)."""
        self.last_reply = self._clock()

    def polled(self, seconds: float) -> None:
        """Records the round trip of a poll that found no message."""
        self.poll_s = seconds

    def now(self) -> float:
        """The clock's time (seconds)."""
        return self._clock()

    def pause(self, flower_s: float) -> float:
        """The pause that replaces Flower's pause of ``flower_s`` seconds."""
        if flower_s >= FLOWER_IDLE_S:
            busy = min(FLOWER_IDLE_S, POLL_COST_FACTOR * self.poll_s)
            return max(idle_pause(self._clock() - self.last_reply), busy)
        return min(flower_s, LOCAL_POLL_S)

    def sleep(self, seconds: float) -> None:
        """Sleeps the paced pause for Flower's ``seconds``."""
        self._sleep(self.pause(seconds))


def pace(
    loop: ModuleType, paced: PacedTime, on_message: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Installs ``paced`` in Flower's SuperNode loop module; returns what undoes it.

    The loop's ``time`` becomes ``paced``, its push step (``_push_messages``, which returns
    once the reply has been sent) marks the node's last reply, and its pull step
    (``_pull_and_store_message``, which returns a run id once a message and all its
    objects are stored) calls ``on_message`` when it stored one, and records its round
    trip when it found none.
    """
    saved = loop.time, loop._push_messages, loop._pull_and_store_message
    saved_push, saved_pull = saved[1], saved[2]

    @functools.wraps(saved_push)
    def push_messages(*args: Any, **kwargs: Any) -> Any:
        try:
            return saved_push(*args, **kwargs)
        finally:
            paced.replied()

    @functools.wraps(saved_pull)
    def pull_and_store_message(*args: Any, **kwargs: Any) -> Any:
        start = paced.now()
        run_id = saved_pull(*args, **kwargs)
        if run_id is None:
            paced.polled(paced.now() - start)
        elif on_message is not None:
            on_message()
        return run_id

    loop.time = paced  # type: ignore[attr-defined]
    loop._push_messages = push_messages  # type: ignore[attr-defined]
    loop._pull_and_store_message = pull_and_store_message  # type: ignore[attr-defined]

    def undo() -> None:
        loop.time, loop._push_messages, loop._pull_and_store_message = saved  # type: ignore[attr-defined]

    return undo


class Wake:
    """The SuperNode's side: one datagram to its worker on 127.0.0.1 per stored message.

    A datagram nobody waits for is dropped; a send that fails is ignored (the worker then
    finds the task at its next fallback ask).

    Args:
        port: The worker's UDP port on 127.0.0.1.
    """

    def __init__(self, port: int) -> None:
        self.address = (_LOOPBACK, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def __call__(self) -> None:
        """Sends the wake datagram (a worker that is not listening misses nothing)."""
        with contextlib.suppress(OSError):
            self.sock.sendto(b"\x01", self.address)


class WakeListener:
    """The worker's side of :class:`Wake`: waits for a datagram on 127.0.0.1:``port``.

    Raises:
        OSError: The port cannot be bound.
    """

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((_LOOPBACK, port))
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a wake; True if one came (all pending are read)."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        woken = False
        while ready:
            try:
                self.sock.recv(16)
                woken = True
            except BlockingIOError:
                break
        return woken

    def close(self) -> None:
        """Releases the port."""
        self.sock.close()


def pinned() -> bool:
    """Whether the installed Flower is the version whose waits this module knows.

    Warns when it is not.
    """
    import flwr

    if flwr.__version__ == FLOWER_VERSION:
        return True
    log.warning(
        "flwr %s is not %s: Flower's own waits apply (3 s between a SuperNode's polls, 1 s"
        " before an object pull is retried)",
        flwr.__version__,
        FLOWER_VERSION,
    )
    return False


def quick_object_pulls(
    first_s: float = FIRST_OBJECT_RETRY_S, cap_s: float = OBJECT_RETRY_CAP_S
) -> Callable[[], None]:
    """Makes Flower's object pulls in this process retry sooner; returns what undoes it.

    Flower's pull functions take their retry pauses as keyword defaults, which every caller
    in Flower leaves alone: setting the defaults reaches all of them.
    """
    from flwr.supercore.inflatable import inflatable_utils as inflatable

    funcs = [inflatable.pull_objects, inflatable.pull_and_inflate_object_from_tree]
    saved = [dict(f.__kwdefaults__ or {}) for f in funcs]
    for f in funcs:
        assert f.__kwdefaults__ is not None
        f.__kwdefaults__.update(initial_backoff=first_s, backoff_cap=cap_s)

    def undo() -> None:
        for f, kw in zip(funcs, saved, strict=True):
            f.__kwdefaults__ = kw

    return undo


def split_args(argv: list[str]) -> tuple[int | None, list[str]]:
    """Fedfm's ``--wake-port`` and the arguments left for Flower's ``flower-supernode``."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--wake-port", type=int, default=None)
    args, rest = ours.parse_known_args(argv)
    return args.wake_port, rest


def main() -> None:
    """Runs ``flower-supernode`` with the arguments of this command, its waits shortened.

    ``--wake-port PORT`` (fedfm's own, taken out before Flower reads the rest) wakes the
    node's warm worker listening on 127.0.0.1:PORT once a message is stored.
    """
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    wake_port, rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0], *rest]
    if pinned():
        pace(loop, PacedTime(), Wake(wake_port) if wake_port is not None else None)
        quick_object_pulls()
    flower_supernode()
