"""Fixtures shared by test modules (their support code is the ``helpers`` package).

A module asks for a fixture by name, or for all its tests with ``pytestmark =
pytest.mark.usefixtures(...)``; none is autouse across the suite.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` each worker gets its share of the cores' threads (torch's and,
    through the environment, the processes a test starts): N workers of all the cores'
    threads each would oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The longest files (minutes each on 2 cores), started first under ``pytest -n N``: a worker
# handed one of them last would run it alone after the others finished.
LONG_FILES = (
    "tests/unit/eval/test_eval_instrument.py",
    "tests/unit/cli/test_harness.py",
    "tests/integration/test_flower_deploy.py",
    "tests/integration/test_docs_deploy.py",
    "tests/unit/runtime/test_flower.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N``, the :data:`LONG_FILES` first (otherwise in collection order)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1:
        rank = {name: i for i, name in enumerate(LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))


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
