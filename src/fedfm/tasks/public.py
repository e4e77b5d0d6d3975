"""A public set: labelled rows that no client holds and that are not test rows.

Methods that train on the server (FedRD's co-training) need a small public proxy set. A task
offers one in one of three ways, each a capability of :mod:`fedfm.tasks.base`: rows by
explicit sample ids (:data:`~fedfm.tasks.base.SOURCE_ROWS`, the config's ``public_ids``), its
own public split (:data:`~fedfm.tasks.base.PUBLIC_SPLIT`, e.g. the text task's
``public_size``), or ``public_size`` rows drawn from the source's training rows that no
client holds (:data:`~fedfm.tasks.base.SOURCE_ROWS` again; e.g. rows left out by
``max_train``). :func:`require_public_set` checks at config load that the task can form the
set the config asks for; :func:`public_split` forms it and refuses any overlap, by sample id,
with a client's data or the test set (in a simulation the server can check this because the
task holds every partition).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedfm.core.seeding import derive_seed
from fedfm.errors import ConfigError
from fedfm.tasks.base import (
    PUBLIC_SPLIT,
    SOURCE_ROWS,
    PublicSplit,
    SourceRows,
    Task,
    TaskConfig,
    capable,
    require,
)


def require_public_set(
    task_cls: type[Task],
    task_cfg: TaskConfig,
    ids: list[int] | None,
    size: int,
    needed_for: str,
) -> None:
    """Refuses, at config load, a task that cannot form the public set a config asks for.

    Args:
        task_cls: The task class.
        task_cfg: Its validated config.
        ids: The config's ``algo.public_ids``.
        size: The config's ``algo.public_size``.
        needed_for: The method that needs the set (named in the error).

    Raises:
        ConfigError: A missing capability, or no public set at all (``algo.public_size``).
    """
    if ids is not None:
        require(task_cls, task_cfg, SOURCE_ROWS, "algo.public_ids", "a public set by ids")
    elif PUBLIC_SPLIT not in task_cls.provides(task_cfg):
        why = "a public set drawn from unused training rows"
        require(task_cls, task_cfg, SOURCE_ROWS, "algo.public_size", why)
        if size <= 0:
            raise ConfigError(
                "algo.public_size", f"{needed_for} needs a public set: set public_size > 0"
            )


def used_ids(task: Any) -> np.ndarray:
    """Sample ids of every client's training and local-test data."""
    parts = []
    for cid in task.client_ids():
        parts += [task.client_data(cid).ids.numpy(), task.client_test_data(cid).ids.numpy()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_public(public_ids: np.ndarray, task: Any, field_name: str) -> None:
    """Refuses a public set that shares sample ids with client data or the test set.

    Raises:
        ConfigError: Shared ids (their number and a few examples are named).
    """
    for what, ids in (("client data", used_ids(task)), ("the test set", task.test_data().ids)):
        shared = np.intersect1d(public_ids, np.asarray(ids))
        if len(shared):
            raise ConfigError(
                field_name,
                f"public set overlaps {what}: {len(shared)} shared sample ids "
                f"(e.g. {shared[:5].tolist()})",
            )


def public_split(
    task: Task, size: int, ids: list[int] | None, seed: int, label: str
) -> tuple[Any, str]:
    """The public proxy set, checked disjoint from client data and the test set.

    Explicit ``ids`` are rows of the source (:data:`~fedfm.tasks.base.SOURCE_ROWS`); else the
    task's public split (:data:`~fedfm.tasks.base.PUBLIC_SPLIT`); else ``size`` rows drawn
    from the source's training rows that no client holds. :func:`require_public_set` has made
    sure the task provides what the config asks for.

    Args:
        task: The task.
        size: Rows to draw from the unused training pool (when neither ``ids`` nor the task
            gives a public set).
        ids: Explicit sample ids from the source's training rows.
        seed: The run's seed.
        label: Names the draw (its seed is derived from ``seed`` and ``label``).

    Returns:
        The data and a short description of where it came from.

    Raises:
        ConfigError: No public set can be formed, or it overlaps client data or the test set.
    """
    if ids is not None:
        missing = np.setdiff1d(np.asarray(ids), capable(task, SourceRows).pool_ids())
        if len(missing):
            raise ConfigError(
                "algo.public_ids",
                f"{len(missing)} ids are not training rows of the task's source"
                f" (e.g. {missing[:5].tolist()})",
            )
        field_name, origin = "algo.public_ids", "explicit ids"
        data = capable(task, SourceRows).rows(ids)
    elif PUBLIC_SPLIT in task.provides(task.cfg):
        field_name, origin = "task.public_size", "the task's public split"
        data = capable(task, PublicSplit).public_data()
    else:
        field_name, origin = "algo.public_size", "unused training rows"
        data = _free_rows(task, size, None, seed, label, "public_size", "")
    check_public(data.ids.numpy(), task, field_name)
    return data, origin


def transfer_split(task: Task, size: int, exclude: np.ndarray, seed: int, label: str) -> Any:
    """An unlabelled transfer pool of ``size`` source training rows that no client holds.

    The rows are not test rows and not in ``exclude`` (the labelled public set), drawn with a seed
    derived from ``seed`` and ``label``. They keep their labels in memory; a method that treats
    the pool as unlabelled must not read them (FedRD reads only its inputs).

    Raises:
        ConfigError: Fewer free rows than ``size`` (field ``algo.transfer_size``), or an
            overlap with client data or the test set.
    """
    data = _free_rows(task, size, exclude, seed, label, "transfer_size", " and not public")
    check_public(data.ids.numpy(), task, "algo.transfer_size")
    return data


def _free_rows(
    task: Task, size: int, exclude: np.ndarray | None, seed: int, label: str, option: str, also: str
) -> Any:
    """``size`` source training rows that no client holds, not test rows and not in ``exclude``.

    Drawn with a seed derived from ``seed`` and ``label``.

    Raises:
        ConfigError: Fewer free rows than ``size`` (field ``algo.<option>``).
    """
    pool_ids = capable(task, SourceRows).pool_ids()
    taken = [used_ids(task), np.asarray(task.test_data().ids)]
    if exclude is not None:
        taken.append(exclude)
    free = np.flatnonzero(~np.isin(pool_ids, np.concatenate(taken)))
    if len(free) < size:
        raise ConfigError(
            f"algo.{option}",
            f"only {len(free)} training rows are held by no client{also}, {size} asked "
            f"(lower task.max_train or {option})",
        )
    rng = np.random.default_rng(derive_seed(seed, label))
    return capable(task, SourceRows).rows(
        pool_ids[np.sort(rng.choice(free, size=size, replace=False))].tolist()
    )
