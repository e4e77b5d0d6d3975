"""Fixtures shared by test modules (their support code is the ``helpers`` package).

A module asks for a fixture by name, or for all its tests with ``pytestmark =
pytest.mark.usefixtures(...)``; none is autouse across the suite.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower's Message constructor reads the process's task identity (set by Flower in a
    ServerApp process); the in-memory grid runs in the test process, so set one here."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture
def fedrd_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedRD's test teachers with empty load records and feature cache (``helpers.fedrd``)."""
    from helpers.fedrd import fresh

    fresh(monkeypatch)
