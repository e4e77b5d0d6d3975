"""The FedRD transfer study at tiny size through the framework: the probe first, the other
arms only where the teacher's margin is resolved, the premise readout checked by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from fedfm.models.encoders import ENCODERS, Encoder, register_encoder
from fedfm.reproduce import fedrd as study
from fedfm.reproduce.framework import open_study, run_study
from helpers.bases import FEDRD

pytestmark = pytest.mark.usefixtures("fedrd_fresh")


def _pixels() -> Encoder:
    # The digits' 64 pixels: a teacher a linear head reads well, unlike the tiny random FMs.
    return Encoder("test-transfer-pixels", 64, lambda x: x.flatten(1))


if "test-transfer-pixels" not in ENCODERS:
    register_encoder("test-transfer-pixels", "images")(_pixels)


def _preset(name: str) -> dict[str, Any]:
    """The study's presets made tiny: digits, four clients, two rounds."""
    cfg = copy.deepcopy(FEDRD)
    cfg["algorithm"] = "fedavg-ft" if name.endswith("-ft") else "fedrd"
    cfg["algo"] = {**cfg["algo"], "teacher": "test-transfer-pixels", "teacher_eval_size": 200}
    cfg["algo"]["warmup_epochs"] = 3.0
    if cfg["algorithm"] == "fedavg-ft":
        cfg["algo"] = {k: v for k, v in cfg["algo"].items() if k in ("public_size", "server_train")}
    cfg["eval_every"] = 2
    return cfg


def _final(folder: Path) -> dict[str, float]:
    return json.loads((folder / "summary.json").read_text())["final"]


@pytest.mark.slow
def test_tiny_grid_probe_first_and_margin_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "preset", _preset)
    task = study.Task("digits", "fedrd-vision", "fedrd-vision-ft")
    grid = study.Grid((task,), seeds=(0, 1), pool=100)
    ctx = open_study(study.STUDY, tmp_path / "s", grid=grid, workers=1)
    report = run_study(study.STUDY, ctx, tmp_path / "report.md")
    folder = tmp_path / "s"
    d = [
        _final(folder / f"digits-paper-s{s}")["teacher/acc"]
        - _final(folder / f"digits-ft-s{s}")["acc"]
        for s in (0, 1)
    ]
    est = study.margin(study.read(ctx), "digits")
    assert est.n == 2 and est.mean == pytest.approx(sum(d) / 2)
    assert est.se == pytest.approx(abs(d[0] - d[1]) / 2)
    jobs = json.loads((folder / "study.json").read_text())["jobs"]
    arms = {name.split("-")[1] for name in jobs}
    # The other arms run exactly when the margin is resolved above zero.
    assert arms == (set(study.ARMS) if est.resolved() > 0 else set(study.PROBE_ARMS))
    text = report.read_text()
    assert "digits, premise: teacher path − fine-tuning control" in text
    if est.resolved() > 0:
        pool = json.loads(
            (folder / "digits-pool-s0" / "metrics.jsonl").read_text().splitlines()[-1]
        )
        assert pool["transfer_steps"] > 0
