"""The FedHDS study runs its grid on a tiny Llama and reports what the runs measured."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from fedfm.reproduce import fedhds as study
from fedfm.reproduce.framework import open_study, run_study

TINY_TASK = {
    "model": "tiny-llama",
    "model_args": {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 8},
    "autocast_bf16": False,
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
    "prompt": {"max_length": 96, "max_prompt_length": 64},
}


def test_quick_grid_reports_the_measured_numbers(tmp_path: Path) -> None:
    methods = ("fedhds", "fedit", "random", "fedhds-x4")
    grid = study.Grid(
        16, 2, 4, 1.0, 1, 5, 4, methods=methods, task=TINY_TASK, partition={"min_size": 2}
    )
    ctx = open_study(study.STUDY, tmp_path, quick=True, grid=grid, command="cmd")
    report = run_study(study.STUDY, ctx, tmp_path / "r.md")
    text = report.read_text()
    hds = json.loads((tmp_path / "fedhds" / "summary.json").read_text())
    fedit = json.loads((tmp_path / "fedit" / "summary.json").read_text())
    # Random ran after FedHDS, at the data fraction FedHDS measured.
    cfg = yaml.safe_load((tmp_path / "random" / "config.yaml").read_text())
    assert cfg["algo"]["random_budget"] == round(hds["finish"]["data_fraction"], 6)
    assert fedit["finish"]["data_fraction"] == 1.0
    record = json.loads((tmp_path / "study.json").read_text())
    assert record["jobs"]["random"]["needs"] == ["fedhds"]
    assert {j["status"] for j in record["jobs"].values()} == {"done"}
    row = next(line for line in text.splitlines() if line.startswith("| FedHDS |"))
    assert f"{hds['final']['rougeL_all']:.3f}" in row
    assert f"{hds['finish']['data_fraction']:.4f}" in row
    assert "## Not run" not in text
    selected = ctx.run("fedhds").audit_bytes("select")
    assert selected > 0 and f"| {selected:,} |" in row
    # The readouts come first; the time ratio is FedIT's training seconds over FedHDS's.
    assert text.index("## Readouts") < text.index("## Setup")
    ratio = fedit["finish"]["total_train_s"] / hds["finish"]["total_train_s"]
    r4 = next(x for x in text.splitlines() if x.startswith("| R4 |"))
    assert f"| {ratio:.1f} |" in r4 and "no SE" in r4
    # The longer control runs 4x the rounds and is compared with FedIT in words.
    x4 = json.loads((tmp_path / "fedhds-x4" / "summary.json").read_text())
    assert x4["rounds"] == 4 * grid.rounds
    assert f"FedHDS, 4× the rounds: Rouge-L {x4['final']['rougeL_all']:.3f}" in text
    assert "Before training" in text  # FedIT's round-0 evaluation of the base model
    # A second invocation runs nothing again.
    again = open_study(study.STUDY, tmp_path, quick=True, grid=grid, command="cmd")
    run_study(study.STUDY, again, tmp_path / "r.md")
    record = json.loads((tmp_path / "study.json").read_text())
    assert [i["ran"] for i in record["invocations"]] == [4, 0]
