"""The warm ClientApp worker's task: Flower's task heartbeat against the SuperNode's rules.

Flower's task heartbeat (the real one here) sends SIGINT to its own process when the
SuperNode refuses a heartbeat, which it does once the task's output is in (its token is
revoked then). A ``flwr-clientapp`` process ends after its one task anyway; the warm
worker serves the next task, so a SIGINT ends it mid-run (code 0, its SuperNode alive).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

pytest.importorskip("flwr")


class _Node:
    """The runtime API of a SuperNode, as one task's client sees it: a heartbeat handled
    after the task's output is refused (Flower's rule: the output revokes the token)."""

    def __init__(self) -> None:
        self.beating = threading.Event()  # a heartbeat is in flight
        self.revoked = threading.Event()  # the task's output is in
        self.events: list[str] = []

    def SendTaskHeartbeat(self, request: Any) -> Any:  # Flower's method name
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse

        self.beating.set()
        # Handled late (a loaded node): after the output, if the worker lets it come then.
        self.revoked.wait(0.3)
        self.events.append("refused heartbeat" if self.revoked.is_set() else "heartbeat")
        return SendTaskHeartbeatResponse(success=not self.revoked.is_set())

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fails", [False, True], ids=["replied", "clientapp-raised"])
def test_no_heartbeat_of_a_task_is_handled_after_its_output(monkeypatch, fails):
    """Failed before the fix: the heartbeat in flight was handled after the output, refused,
    and Flower sent SIGINT to the worker (which then exited with code 0)."""
    import flwr.supernode.runtime.run_clientapp as flower_task

    import fedfm.runtime.flower_app as app
    from fedfm.runtime.flower_app import worker

    node = _Node()

    def pull(client: Any) -> tuple[str, str, None, None]:
        assert node.beating.wait(5.0)  # the task's first heartbeat is on its way
        return "message", "context", None, None

    def client_app(message: str, context: str) -> str:
        if fails:
            raise RuntimeError("the ClientApp raised")
        return "reply"

    def push_output(client: Any, context: Any, status: str, details: str) -> None:
        node.events.append(f"output {status}")
        node.revoked.set()

    monkeypatch.setattr(worker, "_client", lambda *args, **kw: node)
    monkeypatch.setattr(flower_task, "pull_task_input", pull)
    monkeypatch.setattr(app, "client_app", client_app)
    monkeypatch.setattr(flower_task, "push_message", lambda *a: node.events.append("reply"))
    monkeypatch.setattr(flower_task, "push_task_output", push_output)
    monkeypatch.setattr("flwr.app.Message", lambda content, reply_to: f"error reply to {reply_to}")
    sigints: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: sigints.append(signum))
    try:
        worker.run_task("127.0.0.1:1", "token", True, None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sigints == []  # the worker lives on
    status = "failed" if fails else "completed"
    assert node.events == ["reply", "heartbeat", f"output {status}"]
