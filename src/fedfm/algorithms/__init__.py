"""Algorithms, one file each; importing this package registers them."""

from fedfm.algorithms import dpsyn, fedavg, fedekd, fedhds, fedrd, fedsdr  # noqa: F401
from fedfm.algorithms.base import ALGORITHMS


def algo_keys(name: str) -> list[str] | None:
    """Keys of the ``algo`` section algorithm ``name`` takes; None for an unknown algorithm."""
    if name not in ALGORITHMS:
        return None
    return list(ALGORITHMS.get(name).Config.model_fields)
