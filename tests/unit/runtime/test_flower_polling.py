"""The waits of the deployment engine: the server's reply poll and the SuperNode's pacing.

Both run on a fake clock: each test checks when a reply is handed on, how often the grid is
asked, and when a wait gives up, in simulated seconds (no test sleeps).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest

from fedfm.runtime.flower import pacing as N
from fedfm.runtime.flower import server as S
from fedfm.runtime.flower.options import FlowerOptions


class Clock:
    """Simulated monotonic time; ``sleep`` advances it and is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Grid:
    """A grid whose replies become available at set times (None: never).

    Args:
        clock: The simulated clock.
        due: Message id -> when its reply can be pulled.
    """

    def __init__(self, clock: Clock, due: dict[str, float | None]) -> None:
        self.clock = clock
        self.due = dict(due)
        self.pulls: list[float] = []

    def pull_messages(self, ids: list[str]) -> list[Any]:
        self.pulls.append(self.clock.now)
        out = []
        for mid in ids:
            when = self.due.get(mid)
            if when is not None and when <= self.clock.now:
                del self.due[mid]  # a pulled reply leaves the SuperLink
                meta = types.SimpleNamespace(reply_to_message_id=mid)
                out.append(types.SimpleNamespace(metadata=meta, name=f"reply to {mid}"))
        return out


def inbox(due: dict[str, float | None], timeout_s: float = 60.0, poll_s: float = 0.2) -> Any:
    clock = Clock()
    grid = Grid(clock, due)
    options = FlowerOptions(timeout_s=timeout_s, poll_s=poll_s)
    box = S._Inbox(grid, set(due), options, clock=clock, sleep=clock.sleep)
    return box, grid, clock


# ----------------------------------------------------------------------------- server side


def test_replies_are_taken_in_message_order_and_early_ones_wait_in_the_inbox():
    box, grid, clock = inbox({"a": 0.5, "b": 0.1, "c": 0.3})
    assert box.take("a").name == "reply to a"
    assert 0.5 <= clock.now <= 0.5 + 0.2  # at most one pause after it arrived
    # b and c came first: they were pulled while waiting for a, and are handed on now
    # without another pull or pause.
    pulls, now = len(grid.pulls), clock.now
    assert box.take("b").name == "reply to b" and box.take("c").name == "reply to c"
    assert (len(grid.pulls), clock.now) == (pulls, now)
    assert not box.pending and not box.got


def test_the_first_pull_comes_at_once_and_pauses_double_up_to_poll_s():
    box, grid, clock = inbox({"a": 0.0})
    assert box.take("a") is not None
    assert grid.pulls == [0.0] and clock.sleeps == []

    box, grid, clock = inbox({"a": 5.0})
    assert box.take("a") is not None
    assert clock.sleeps[:6] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.2])
    assert max(clock.sleeps) == 0.2 and 5.0 <= clock.now <= 5.2
    assert len(grid.pulls) <= 5.0 / 0.2 + 6  # about five pulls a second, not a busy loop


def test_the_pause_starts_short_again_after_a_reply():
    box, grid, clock = inbox({"a": 2.0, "b": None})
    box.take("a")
    assert clock.sleeps[-1] == 0.2  # the wait for a had grown to poll_s
    waited_for_a, b_due = len(clock.sleeps), clock.now + 0.02
    grid.due["b"] = b_due
    box.take("b")
    assert clock.sleeps[waited_for_a:] == [0.01, 0.02]
    assert clock.now - b_due < 0.02  # b, close behind, is caught within milliseconds


def test_a_client_that_never_answers_fails_after_timeout_s_and_the_rest_still_count():
    box, grid, clock = inbox({"a": None, "b": 0.2, "c": 3.5}, timeout_s=3.0)
    assert box.take("a") is None
    assert clock.now == pytest.approx(3.0) and box.waited() == pytest.approx(3.0)
    # b arrived within the timeout: it is handed on, with no further wait.
    now = clock.now
    assert box.take("b").name == "reply to b" and clock.now == now
    # c comes too late: one last pull, no pause, and it fails as well.
    pulls = len(grid.pulls)
    assert box.take("c") is None
    assert clock.now == now and len(grid.pulls) == pulls + 1


def test_a_message_the_superlink_refused_is_never_waited_for():
    box, grid, clock = inbox({"a": 0.1})
    assert box.take("not pushed") is None
    assert grid.pulls == [] and clock.now == 0.0


# ----------------------------------------------------------------------------- SuperNode side


def test_idle_pause_grows_with_the_idle_time_within_bounds():
    assert N.idle_pause(0.0) == N.MIN_PAUSE_S == 0.05
    assert N.idle_pause(10.0) == pytest.approx(0.5)  # 5 % of the time since the last reply
    assert N.idle_pause(3600.0) == N.FLOWER_IDLE_S == 3.0  # never slower than Flower's


def test_paced_time_maps_flowers_pauses_and_keeps_the_rest_of_time():
    clock = Clock()
    paced = N.PacedTime(clock=clock, sleep=clock.sleep)
    paced.sleep(3)  # Flower's idle pause, right after the start
    paced.sleep(0.5)  # Flower's wait for the ClientApp's reply
    assert clock.sleeps == [0.05, 0.01]
    clock.now = 20.0
    paced.sleep(3)
    assert clock.sleeps[-1] == pytest.approx(1.0)
    paced.replied()
    paced.sleep(3)
    assert clock.sleeps[-1] == 0.05
    # A SuperLink that took 20 ms to say "no message" is asked at most every 200 ms
    # (never less often than Flower's 3 s).
    paced.polled(0.02)
    paced.sleep(3)
    assert clock.sleeps[-1] == pytest.approx(0.2)
    paced.polled(1.0)
    paced.sleep(3)
    assert clock.sleeps[-1] == 3.0
    paced.polled(0.001)  # a quick answer: the idle pause again (5 % of 3.25 s idle)
    paced.sleep(3)
    assert clock.sleeps[-1] == pytest.approx(0.05 * 3.25)
    import time

    assert paced.monotonic is time.monotonic and paced.time is time.time


def test_pace_marks_each_reply_wakes_on_each_message_and_undoes_itself():
    clock = Clock()

    def push_messages(**kw: Any) -> str:
        clock.now += 1.0  # the reply takes a second to leave
        return "pushed"

    pulled: list[int | None] = [None, 7]

    def pull_and_store_message(**kw: Any) -> int | None:
        clock.now += 0.25  # a slow SuperLink: each poll takes 250 ms
        return pulled.pop(0)  # first no message, then one of run 7

    loop = types.ModuleType("loop")
    loop.time = "the time module"  # type: ignore[attr-defined]
    loop._push_messages = push_messages  # type: ignore[attr-defined]
    loop._pull_and_store_message = pull_and_store_message  # type: ignore[attr-defined]
    paced = N.PacedTime(clock=clock, sleep=clock.sleep)
    clock.now = 100.0
    wakes: list[float] = []
    undo = N.pace(loop, paced, on_message=lambda: wakes.append(clock.now))
    assert loop.time is paced
    assert loop._push_messages(state=None) == "pushed"
    assert paced.last_reply == 101.0  # marked when the push step returned
    assert loop._pull_and_store_message(state=None) is None and wakes == []
    assert paced.poll_s == 0.25  # the empty poll's round trip
    assert loop._pull_and_store_message(state=None) == 7 and wakes == [101.5]
    assert paced.poll_s == 0.25  # a poll that brought a message (and its objects) is no measure
    undo()
    assert loop.time == "the time module" and loop._push_messages is push_messages
    assert loop._pull_and_store_message is pull_and_store_message


def test_a_wake_reaches_the_worker_on_loopback_and_a_lost_one_only_costs_the_fallback():
    from fedfm.runtime.flower.processes import free_port

    port = free_port(udp=True)
    listener = N.WakeListener(port)
    try:
        assert listener.wait(0.0) is False  # nothing sent yet: returns after the timeout
        wake = N.Wake(port)
        wake()
        wake()  # two messages in before the worker looked: one ask reads both
        assert listener.wait(5.0) is True
        assert listener.wait(0.0) is False
        with pytest.raises(OSError):
            N.WakeListener(port)  # taken: the worker falls back to polling
    finally:
        listener.close()
    N.Wake(port)()  # nobody listens any more: the send is dropped, nothing raises


def test_the_wake_port_is_fedfms_and_the_rest_goes_to_flower():
    argv = ["--superlink", "h:1", "--wake-port", "4242", "--isolation", "process"]
    assert N.split_args(argv) == (4242, ["--superlink", "h:1", "--isolation", "process"])
    assert N.split_args(["--insecure"]) == (None, ["--insecure"])


def test_a_worker_whose_wake_port_is_taken_polls_as_before(caplog):
    import functools
    import time

    from fedfm.runtime.flower.processes import free_port
    from fedfm.runtime.flower_app import worker

    port = free_port(udp=True)
    taken = N.WakeListener(port)
    try:
        idle, waking = worker._idle_wait(port, 0.05)
        assert isinstance(idle, functools.partial) and idle.func is time.sleep
        assert idle.args == (0.05,) and not waking and "asking every 0.05 s" in caplog.text
    finally:
        taken.close()
    idle, waking = worker._idle_wait(port, 0.05)
    assert waking and getattr(idle, "args", None) == (N.WAKE_FALLBACK_S,)  # waits for a wake
    idle.func.__self__.close()  # type: ignore[attr-defined]
    idle, waking = worker._idle_wait(None, 0.05)
    assert getattr(idle, "args", None) == (0.05,) and not waking


def test_the_pinned_flower_supernode_loop_has_the_pauses_that_are_paced():
    """Fails when a new flwr changes the loop: its pauses must then be read again."""
    flwr = pytest.importorskip("flwr")
    from flwr.supernode import start_client_internal as loop

    assert flwr.__version__ == N.FLOWER_VERSION
    source = inspect.getsource(loop)
    assert source.count("time.sleep(3)") == 1  # the idle pause after an empty poll
    assert source.count("time.sleep(0.5)") == 2  # local waits for the reply and its objects
    assert "_push_messages(" in inspect.getsource(loop.start_client_internal)
    # The pull step returns its run id only after the message's objects are all stored
    # (and confirmed): the moment the worker is woken.
    pull = inspect.getsource(loop._pull_and_store_message)
    assert pull.index("object_store.put(obj_id") < pull.index("confirm_message_received(")
    assert pull.rstrip().endswith("return run_id")
    undo = N.pace(loop, N.PacedTime())
    try:
        assert isinstance(loop.time, N.PacedTime)
    finally:
        undo()
    import time

    assert loop.time is time


def test_quick_object_pulls_reach_every_pull_and_undo_themselves():
    pytest.importorskip("flwr")
    from flwr.supercore.inflatable import inflatable_utils as inflatable

    funcs = [inflatable.pull_objects, inflatable.pull_and_inflate_object_from_tree]
    # flwr 1.42 retries an object that is not uploaded yet after 1 s, doubling up to 10 s.
    assert [
        (f.__kwdefaults__["initial_backoff"], f.__kwdefaults__["backoff_cap"]) for f in funcs
    ] == [
        (1, 10),
        (1, 10),
    ]
    # The message pulls of the SuperNode and of the ServerApp's grid leave them as they are.
    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal as loop

    for module in (loop, http_grid):
        assert "initial_backoff" not in inspect.getsource(module)
    undo = N.quick_object_pulls()
    try:
        for f in funcs:
            assert f.__kwdefaults__["initial_backoff"] == N.FIRST_OBJECT_RETRY_S == 0.02
            assert f.__kwdefaults__["backoff_cap"] == N.OBJECT_RETRY_CAP_S == 2.0
            assert f.__kwdefaults__["max_tries_per_object"] == 500  # Flower's patience kept
    finally:
        undo()
    assert [f.__kwdefaults__["initial_backoff"] for f in funcs] == [1, 1]
