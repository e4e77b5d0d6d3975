"""Stages: an algorithm's rounds as named phases, each with its round count.

Most algorithms repeat one round (FedAvg and its kin: ``rounds`` comes from the config). An
algorithm whose rounds do different things in a fixed order declares its stages instead
(:meth:`fedfm.algorithms.base.Algorithm.stages`, e.g. dpsyn: ``train`` for
``algo.train_rounds`` rounds, then ``generate`` and ``vote`` once each). The engine then
derives the run's ``rounds`` from them when the config does not give it, and refuses more
rounds than the stages hold; a config's ``rounds`` below their total still stops the run after
that round (resuming with more rounds goes on where it stopped). The server half asks which
stage a round belongs to (:func:`stage_at`) instead of comparing round numbers itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedfm.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """A named phase of consecutive rounds.

    Attributes:
        name: What the rounds of the stage do (e.g. ``train``).
        rounds: How many rounds it takes (0: the stage is skipped).
    """

    name: str
    rounds: int

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"stage {self.name!r} has {self.rounds} rounds")


def total_rounds(stages: Sequence[Stage]) -> int:
    """Rounds after round 0 that the stages hold."""
    return sum(s.rounds for s in stages)


def stage_at(stages: Sequence[Stage], rnd: int) -> str | None:
    """The name of the stage that round ``rnd`` belongs to (rounds count from 1).

    ``None`` for round 0 (the algorithm's setup) and for rounds beyond the last stage.
    """
    if rnd < 1:
        return None
    end = 0
    for s in stages:
        end += s.rounds
        if rnd <= end:
            return s.name
    return None


def describe(stages: Sequence[Stage]) -> str:
    """``train 3 + generate 1 + vote 1``."""
    return " + ".join(f"{s.name} {s.rounds}" for s in stages)


def staged_rounds(
    stages: Sequence[Stage], rounds: int, given: bool, algorithm: str, origin: str = ""
) -> int:
    """The run's rounds under ``stages``.

    Args:
        stages: The algorithm's stages (empty: rounds as given).
        rounds: The config's ``rounds``.
        given: Whether the config gave ``rounds`` (else it is the default).
        algorithm: The algorithm's name, for the error.
        origin: Where the stages' counts come from (e.g. ``algo.train_rounds``), for the error.

    Returns:
        ``rounds`` when given (or without stages), else the stages' total.

    Raises:
        ConfigError: ``rounds`` (given) beyond the stages' total.
    """
    if not stages:
        return rounds
    total = total_rounds(stages)
    if not given:
        return total
    if rounds > total:
        whence = f"; {origin}" if origin else ""
        raise ConfigError(
            "rounds",
            f"{algorithm} has {total} rounds after round 0 ({describe(stages)}{whence}),"
            f" got {rounds}",
        )
    return rounds
