"""Stages: the round each stage owns, the rounds a run derives from them, and dpsyn's."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfm.algorithms.dpsyn import DPSyn, DPSynConfig
from fedfm.config import load_config
from fedfm.core.stages import Stage, stage_at, staged_rounds, total_rounds
from fedfm.engine import with_stages
from fedfm.errors import ConfigError
from helpers.bases import DPSYN
from helpers.config import TOY, make_config

STAGES = (Stage("train", 2), Stage("skipped", 0), Stage("generate", 1), Stage("vote", 1))


def test_each_round_belongs_to_one_stage_and_empty_stages_are_skipped() -> None:
    assert total_rounds(STAGES) == 4
    got = [stage_at(STAGES, r) for r in range(6)]
    assert got == [None, "train", "train", "generate", "vote", None]  # round 0 is the setup
    with pytest.raises(ValueError, match="rounds"):
        Stage("bad", -1)


def test_rounds_come_from_the_stages_unless_the_config_gives_them() -> None:
    assert staged_rounds(STAGES, 10, given=False, algorithm="a") == 4  # the default: every stage
    assert staged_rounds(STAGES, 2, given=True, algorithm="a") == 2  # stops after round 2
    assert staged_rounds(STAGES, 4, given=True, algorithm="a") == 4
    assert staged_rounds((), 7, given=False, algorithm="a") == 7  # no stages: as configured
    with pytest.raises(ConfigError) as err:
        staged_rounds(STAGES, 5, given=True, algorithm="a", origin="train: algo.x")
    assert err.value.field == "rounds"
    assert "train 2 + skipped 0 + generate 1 + vote 1; train: algo.x" in str(err.value)


def test_dpsyn_declares_its_stages_and_a_run_derives_its_rounds(tmp_path: Path) -> None:
    assert DPSyn.stages(DPSynConfig(train_rounds=3)) == (
        Stage("train", 3),
        Stage("generate", 1),
        Stage("vote", 1),
    )
    given = load_config(make_config(DPSYN, tmp_path, rounds=2))
    assert with_stages(given).rounds == 2  # a given rounds means what it meant
    implicit = make_config(DPSYN, tmp_path, algo__train_rounds=4)
    del implicit["rounds"]
    assert load_config(implicit).rounds == 10  # the config's default...
    assert with_stages(load_config(implicit)).rounds == 6  # ...gives way to the stages
    with pytest.raises(ConfigError) as err:
        with_stages(load_config(make_config(DPSYN, tmp_path, rounds=4)))  # train_rounds 1
    assert err.value.field == "rounds"
    toy = load_config(make_config(TOY, tmp_path))
    assert with_stages(toy) is toy  # an algorithm without stages: untouched
