"""Flower's SuperNode with its waits paced: ``python -m fedfm.runtime.flower.supernode ARGS``.

The loop of Flower 1.42's SuperNode (``flwr.supernode.start_client_internal``) asks the
SuperLink for a message and, when none is waiting, sleeps 3 s before it asks again; once a
message is in, it looks every 0.5 s whether its ClientApp has replied. Neither pause is a
setting: ``flower-supernode`` has no option, node-config key or environment variable for
them (both are literals in the loop), and its one interval that is named, the heartbeat
(``HEARTBEAT_DEFAULT_INTERVAL``, 30 s, fixed too), only tells the SuperLink the node is
alive. Each exchange of a round therefore waits on average 1.5 s (up to 3 s; the last of
ten nodes nearly 3 s) before a node even sees its message, and up to 0.5 s more before its
reply leaves.

This entry point runs Flower's own ``flower-supernode`` (same arguments, same loop, same
log lines) with those two pauses replaced:

- after an empty poll the node waits :data:`IDLE_FRACTION` of the time since it last
  replied, at least :data:`MIN_PAUSE_S` and at most Flower's 3 s: right after a reply
  (while the server gathers the other replies and aggregates) it asks every 50 ms, so a
  message waits at most about 5 % of the node's idle time; a node idle for a minute or more
  asks every 3 s as Flower's does, so an idle deployment loads the SuperLink no more;
- the wait for the ClientApp's reply, a look into the node's own memory (no network), is
  :data:`LOCAL_POLL_S` instead of 0.5 s.

The pauses are replaced only on the Flower version they were read from (the pinned one);
on another one the SuperNode runs as Flower ships it, with a warning.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("fedfm")

#: The Flower version whose SuperNode loop this paces.
FLOWER_VERSION = "1.42.0"
#: Flower's pause after a poll of the SuperLink that found no message (seconds).
FLOWER_IDLE_S = 3.0
#: Pause after an empty poll, as a fraction of the time since the node last replied.
IDLE_FRACTION = 0.05
#: Shortest pause after an empty poll (seconds): at most 20 polls a second per node.
MIN_PAUSE_S = 0.05
#: Pause between two looks for the ClientApp's reply in the node's own state (seconds).
LOCAL_POLL_S = 0.01


def idle_pause(idle_s: float) -> float:
    """Seconds to wait after an empty poll, ``idle_s`` seconds after the node last replied."""
    return min(FLOWER_IDLE_S, max(MIN_PAUSE_S, IDLE_FRACTION * idle_s))


class PacedTime:
    """Stands in for the ``time`` module inside Flower's SuperNode loop.

    Every function is :mod:`time`'s own except :meth:`sleep`, which maps Flower's pauses to
    paced ones: its idle pause (:data:`FLOWER_IDLE_S`) to :func:`idle_pause`, its shorter
    local waits to at most :data:`LOCAL_POLL_S`.

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

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def replied(self) -> None:
        """Marks the moment the node finished handling a message (its reply left)."""
        self.last_reply = self._clock()

    def pause(self, flower_s: float) -> float:
        """The pause that replaces Flower's pause of ``flower_s`` seconds."""
        if flower_s >= FLOWER_IDLE_S:
            return idle_pause(self._clock() - self.last_reply)
        return min(flower_s, LOCAL_POLL_S)

    def sleep(self, seconds: float) -> None:
        """Sleeps the paced pause for Flower's ``seconds``."""
        self._sleep(self.pause(seconds))


def pace(loop: ModuleType, paced: PacedTime) -> Callable[[], None]:
    """Installs ``paced`` in Flower's SuperNode loop module; returns what undoes it.

    The loop's ``time`` becomes ``paced``, and its push step (``_push_messages``, which
    returns once the reply has been sent) marks the node's last reply.
    """
    saved_time, saved_push = loop.time, loop._push_messages

    @functools.wraps(saved_push)
    def push_messages(*args: Any, **kwargs: Any) -> Any:
        try:
            return saved_push(*args, **kwargs)
        finally:
            paced.replied()

    loop.time = paced  # type: ignore[attr-defined]
    loop._push_messages = push_messages

    def undo() -> None:
        loop.time, loop._push_messages = saved_time, saved_push  # type: ignore[attr-defined]

    return undo


def main() -> None:
    """Runs ``flower-supernode`` with the arguments of this command, its waits paced."""
    import flwr
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if flwr.__version__ == FLOWER_VERSION:
        pace(loop, PacedTime())
    else:
        logging.basicConfig(level=logging.WARNING)
        log.warning(
            "flwr %s is not %s: the SuperNode polls at Flower's own intervals (3 s idle)",
            flwr.__version__,
            FLOWER_VERSION,
        )
    flower_supernode()


if __name__ == "__main__":
    main()
