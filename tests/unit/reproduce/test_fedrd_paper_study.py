"""The FedRD study: its report's paired differences by hand, and the quick grid end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedfm.reproduce.fedrd_paper import STUDY, Cell, Grid, differences, per_seed, read
from fedfm.reproduce.framework import open_study, reproduce, write_report


def _fake_run(out: Path, job: Cell, accs: dict[int, float]) -> None:
    """A run folder whose metrics.jsonl has test accuracy ``accs[round]``."""
    folder = out / job.name
    folder.mkdir(parents=True)
    rows = [{"round": 0, "public_size": 10}]
    rows += [
        {"round": r, "acc": a, "macro_f1": a / 2, "bytes_up": 100, "server_loss": 1.0}
        for r, a in accs.items()
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_differences_and_curves_by_hand(tmp_path: Path) -> None:
    grid = Grid(alphas=(0.5,), seeds=(0, 1, 2), methods=("ft", "fedrd"), rounds=4, eval_every=2)
    final = {"fedrd": [0.80, 0.70, 0.90], "ft": [0.75, 0.70, 0.80]}
    for m, accs in final.items():
        for s, a in enumerate(accs):
            _fake_run(tmp_path, Cell("vision", 0.5, s, m), {2: a - 0.1, 4: a})
    # a run that stopped at round 2 is not a finished cell
    _fake_run(tmp_path, Cell("vision", 0.1, 0, "fedrd"), {2: 0.5})
    ctx = open_study(STUDY, tmp_path, quick=True, grid=grid, command="x")
    res = read(ctx)
    assert per_seed(res, grid, "vision", 0.5, "fedrd", "acc") == {0: 0.80, 1: 0.70, 2: 0.90}
    d = differences(grid, res, "vision", 0.5)["ft"]["acc"]
    # per-seed differences 0.05, 0.00, 0.10: mean 0.05, SD 0.05, SE 0.05 / √3
    assert d.n == 3 and d.mean == pytest.approx(0.05)
    assert d.se == pytest.approx(0.05 / 3**0.5)
    assert d.resolved() == 0  # 0.05 < 2 · 0.0289
    report = write_report(STUDY, ctx, tmp_path / "r.md")
    text = report.read_text()
    assert "+0.050 ± 0.029" in text  # the paired difference, in the headline and the table
    assert "| 0.5 | FedRD | yes | 0.800 ± 0.058 |" in text  # mean ± SE of 0.8, 0.7, 0.9
    assert "round 2 | round 4" in text
    assert "Fed-CRD, Fed-VID and SemCKD, are not implemented" in text
    # The readouts open the page: FedRD against the public fine-tuning control, per seed.
    r1 = next(x for x in text.splitlines() if x.startswith("| R1 |"))
    assert "public fine-tuning" in r1 and "+0.050 ± 0.029" in r1 and "not resolved" in r1
    assert text.index("## Readouts") < text.index("## The method in brief")


def test_quick_study_runs_and_reports_measured_numbers(tmp_path: Path) -> None:
    report = reproduce("fedrd_paper", tmp_path, quick=True)
    assert report == tmp_path / "fedrd_paper-quick" / "fedrd_paper-quick.md"
    assert isinstance(report, Path)
    text = report.read_text()
    assert "7 runs; 7 finished" in text
    assert "did not finish" not in text
    # every method has a measured accuracy in the results table
    for label in ("student FedAvg + public fine-tuning", "FedRD without φ", "Fed-Hint"):
        assert re.search(rf"\| 0\.5 \| {re.escape(label)}[^|]* \| yes \| 0\.\d{{3}} \|", text)
    assert re.search(r"\| 32 px \| 0\.\d{3} \|", text)  # the probe
    assert (
        tmp_path / "fedrd_paper-quick" / "fedrd_paper-quick" / "accuracy_over_rounds.png"
    ).exists()
    record = json.loads((tmp_path / "fedrd_paper-quick" / "study.json").read_text())
    assert {j["status"] for j in record["jobs"].values()} == {"done"}
    assert record["jobs"]["lite0-probe"]["kind"] == "compute" and len(record["jobs"]) == 8
    probe = json.loads((tmp_path / "fedrd_paper-quick" / "lite0-probe" / "result.json").read_text())
    assert f"| 32 px | {probe['result']['32']['acc']:.3f} |" in text
