"""The hetero study runs its grid on a tiny Llama through the framework and reports it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedfm.reproduce import hetero as study
from fedfm.reproduce.framework import open_study, run_study

TINY_TASK = {
    "model": "tiny-llama",
    "model_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 8},
    "autocast_bf16": False,
    "prompt": {"max_length": 96, "max_prompt_length": 64},
    "eval_batch_size": 4,
}
GRID = study.Grid(
    rounds=1, steps=1, per_domain_train=3, per_domain_test=2, clients=3, seeds=(0, 1),
    task=TINY_TASK, partition={"min_size": 2}, label="tiny",
)  # fmt: skip


@pytest.mark.slow
def test_tiny_grid_runs_every_arm_and_reports_the_bill(tmp_path: Path) -> None:
    ctx = open_study(study.STUDY, tmp_path, grid=GRID, command="cmd")
    text = run_study(study.STUDY, ctx, tmp_path / "r.md").read_text()
    record = json.loads((tmp_path / "study.json").read_text())
    names = [study.job_name(m, s) for s in GRID.seeds for m in study.METHODS]
    assert sorted(record["jobs"]) == sorted(names)
    assert {j["status"] for j in record["jobs"].values()} == {"done"}
    cfg = yaml.safe_load((tmp_path / "svd-s1" / "config.yaml").read_text())
    assert cfg["task"]["lora"]["client_ranks"] == [4, 8, 16] and cfg["seed"] == 1
    assert cfg["task"]["lora"]["alpha"] == 32.0
    nf4 = json.loads((tmp_path / "r8-nf4-s0" / "summary.json").read_text())["comm"]
    f32 = json.loads((tmp_path / "r8-s0" / "summary.json").read_text())["comm"]
    assert nf4["gb_total"] < f32["gb_total"] / 6  # 4 bits and a scale per 64 values
    # Each client of a mixed run pays for its own rank: 4, 8 and 16 (tensor bytes; the bill
    # adds each reply's few meta bytes).
    audit = (tmp_path / "svd-s0" / "audit.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in audit]
    ups = sorted(r["bytes"] for r in rows if r["direction"] == "up" and r["type"] == "arrays")
    assert ups[1] == 2 * ups[0] and ups[2] == 4 * ups[0]
    svd = json.loads((tmp_path / "svd-s0" / "summary.json").read_text())["comm"]["per_client"]
    assert sorted(v["gb_up"] for v in svd.values())[2] == pytest.approx(ups[2] / 1e9, rel=1e-2)
    # The readouts come first, with a verdict each, then the levels and each client's bill.
    assert text.index("SVD re-projection − naive zero-padding") < text.index("## Setup")
    assert "total GB, r8 nf4 / r8 float32" in text and "MB up" in text
    assert "Not finished" not in text
