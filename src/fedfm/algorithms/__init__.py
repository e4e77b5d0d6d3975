"""Algorithms, one file each; importing this package registers them."""

from fedfm.algorithms import fedavg, fedekd, fedrd  # noqa: F401
