"""The FedHDS study runs its grid on a tiny Llama and reports what the runs measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fedfm.reproduce import fedhds as study

TINY_TASK = {
    "model": "tiny-llama",
    "model_args": {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 8},
    "autocast_bf16": False,
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
    "prompt": {"max_length": 96, "max_prompt_length": 64},
}


def test_quick_grid_reports_the_measured_numbers(tmp_path: Path, monkeypatch) -> None:
    real = study._preset

    def tiny_preset() -> dict[str, Any]:
        cfg = real()
        cfg["task"].update(TINY_TASK)
        cfg["partition"]["min_size"] = 2
        return cfg

    methods = [m for m in study.METHODS if m.key in ("fedhds", "fedit", "random", "fedhds-x4")]
    monkeypatch.setattr(study, "_preset", tiny_preset)
    monkeypatch.setattr(study, "METHODS", tuple(methods))
    grid = study.Grid(16, 2, 4, 1.0, 1, 5, 4)
    notes = study.run_grid(grid, tmp_path)
    report = study.write_report(grid, tmp_path, tmp_path / "r.md", "cmd", notes)
    text = report.read_text()
    hds = json.loads((tmp_path / "fedhds" / "summary.json").read_text())
    fedit = json.loads((tmp_path / "fedit" / "summary.json").read_text())
    # Random trains at FedHDS's measured data fraction.
    cfg = yaml.safe_load((tmp_path / "random" / "config.yaml").read_text())
    assert cfg["algo"]["random_budget"] == round(hds["finish"]["data_fraction"], 6)
    assert fedit["finish"]["data_fraction"] == 1.0
    row = next(line for line in text.splitlines() if line.startswith("| FedHDS |"))
    assert f"{hds['final']['rougeL_all']:.3f}" in row
    assert f"{hds['finish']['data_fraction']:.4f}" in row
    assert "Target" in text and "## Not run" not in text
    assert study._select_uplink(tmp_path / "fedhds") > 0
    assert f"| {study._select_uplink(tmp_path / 'fedhds'):,} |" in row
    # The longer control runs 4x the rounds and is compared with FedIT in words.
    x4 = json.loads((tmp_path / "fedhds-x4" / "summary.json").read_text())
    assert x4["rounds"] == 4 * grid.rounds
    assert f"FedHDS, 4× the rounds: Rouge-L {x4['final']['rougeL_all']:.3f}" in text
    assert "Before training" in text  # FedIT's round-0 evaluation of the base model
    # A second invocation runs nothing again.
    study.run_grid(grid, tmp_path)
    timing = [json.loads(x) for x in (tmp_path / "timing.jsonl").read_text().splitlines()]
    assert [t["runs"] for t in timing] == [4, 0]
