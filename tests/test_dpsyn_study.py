"""The dpsyn reproduction study: its grid, resumability, paired statistics and report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fedfm.config import load_config
from fedfm.reproduce import STUDIES, load_studies
from fedfm.reproduce import dpsyn as study
from fedfm.reproduce.dpsyn import FULL, QUICK, Cell, Data, Grid
from fedfm.reproduce.framework import open_study, run_study
from fedfm.reproduce.tables import num

TINY = Grid(
    data=(Data("rotten_tomatoes", clients=4, rows=40, strong=(0.5,)),),
    partitions=("iid",),
    epsilons=(8.0,),
    test_rows=30,
    train_rounds=1,
    steps=2,
    batch_size=8,
    num_samples=16,
    max_new_tokens=6,
    max_length=48,
    k=2,
    clf_steps=10,
    task={
        "lm": "tiny-llama",
        "lm_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 31},
        "lora": {"r": 4, "alpha": 8},
        "autocast_bf16": False,
        "max_test": 30,
    },
    algo={"embedder": "hashed-ngrams", "generation": {"batch_size": 8}},
    label="test grid",
)


def _rows(run: Path) -> dict[int, dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {int(r["round"]): r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, int]:
    """The tiny grid run twice: (runs folder, report, runs of the 1st call, of the 2nd)."""
    tmp = tmp_path_factory.mktemp("dpsyn-study")
    out, report = tmp / "runs", tmp / "report.md"
    ran, stamps = [], {}
    for i in range(2):
        ctx = open_study(study.STUDY, out, grid=TINY, command="test")
        run_study(study.STUDY, ctx, report)
        ran.append(ctx.record.invocations[-1]["ran"])
        if i == 0:
            stamps = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    return out, report, ran[0], ran[1]


def test_the_grid_runs_and_a_second_invocation_runs_nothing(done: Any) -> None:
    out, report, first, second = done
    names = [c.name for c in TINY.cells()]
    assert names == ["rotten_tomatoes-iid-floor-seed0", "rotten_tomatoes-iid-s0.5-e8-seed0"]
    assert (first, second) == (2, 0)
    for name in names:
        assert (out / name / "summary.json").exists()
    assert "did not finish" not in report.read_text()


def test_the_report_prints_the_numbers_of_the_runs(done: Any) -> None:
    out, report, _, _ = done
    text = report.read_text().splitlines()
    for cell in TINY.cells():
        rows = _rows(out / cell.name)
        r = 0 if cell.epsilon is None else TINY.train_rounds
        for rnd, label in ((r + 1, "generated"), (r + 2, "after voting")):
            line = next(x for x in text if x.startswith(f"| `{cell.name}` |") and label in x)
            cells = [c.strip() for c in line.split("|")[3:-2]]
            want = [num(rows[rnd].get(m)) for m, _, _ in study.METRICS]
            assert cells == want
    floor = _rows(out / TINY.cells()[0].name)[1]
    line = next(x for x in text if "ceiling" in x)
    assert num(floor["real/acc"]) in line.split("|")[3]
    strong = json.loads((out / TINY.cells()[1].name / "summary.json").read_text())["finish"]
    privacy = text[text.index("## Privacy per run") :]
    line = next(x for x in privacy if x.startswith(f"| `{TINY.cells()[1].name}` | "))
    assert f"{strong['epsilon/strong']:.2f}" in line and f"{strong['epsilon/weak']:.2f}" in line


def test_items_reproduce_the_logged_scores_and_pair_over_test_rows(done: Any) -> None:
    out, _, _, _ = done
    cell = TINY.cells()[1]
    res = study.read(open_study(study.STUDY, out, grid=TINY))[cell.name]
    for rnd, name in ((2, "gen"), (3, "vote")):
        row, items = _rows(out / cell.name)[rnd], res.items[name]
        assert len(items) == TINY.test_rows
        for clf, prefix in study.CLASSIFIERS:
            acc = sum(int(it[clf]) == it["y"] for it in items) / len(items)
            assert acc == pytest.approx(row[f"{prefix}acc"])
            assert study.macro_f1_of(items, clf) == pytest.approx(row[f"{prefix}macro_f1"])
    d = study.acc_diff(res.items["vote"], res.items["gen"], "logreg")
    assert d.mean == pytest.approx(res.vote["acc"] - res.gen["acc"]) and d.n == TINY.test_rows


def test_paired_differences_by_hand() -> None:
    a = [{"id": i, "y": 0, "m": p} for i, p in enumerate([0, 0, 0, 1])]  # 3 of 4 right
    b = [{"id": i, "y": 0, "m": p} for i, p in enumerate([0, 1, 1, 1])]  # 1 of 4 right
    d = study.acc_diff(a, b, "m")  # per-row differences 0, 1, 1, 0
    assert d.mean == 0.5 and d.n == 4
    assert d.se == pytest.approx(math.sqrt(1 / 3) / 2)  # sd (ddof 1) of [0,1,1,0] / √4
    f = study.f1_diff(a, a, "m")
    assert f.mean == 0 and f.se == 0  # a set against itself: every resample differs by 0
    g = study.f1_diff(a, b, "m")
    assert g.mean == pytest.approx(study.macro_f1_of(a, "m") - study.macro_f1_of(b, "m"))
    assert g.se > 0


def test_with_and_without_voting_come_from_one_run() -> None:
    names = [c.name for c in FULL.cells()]
    assert len(names) == len(set(names))
    assert not any("vote" in n for n in names)  # no separate "without voting" runs
    per_group = 1 + 3 * 3  # floor + 3 strong shares × 3 ε (Rotten Tomatoes)
    assert sum(n.startswith("rotten_tomatoes-iid-") for n in names) == per_group
    quick = [(c.data, c.partition, c.setting) for c in QUICK.cells()]
    first = [s for d, p, s in quick if (d, p) == ("rotten_tomatoes", "iid")]
    assert first == ["floor", "s0.1-e8", "s0.1-einf", "s0.5-e8", "s0.1-e1"]  # settings' order
    # The other groups run only their own settings, each after its floor.
    assert quick[len(first) :] == [
        ("rotten_tomatoes", "noniid", "floor"),
        ("rotten_tomatoes", "noniid", "s0.1-e8"),
        ("drug_reviews", "iid", "floor"),
        ("drug_reviews", "iid", "s0.1-e8"),
    ]


@pytest.mark.parametrize("grid", [QUICK, FULL])
def test_every_cell_is_a_valid_config(grid: Grid, tmp_path: Path) -> None:
    for cell in grid.cells():
        cfg = load_config(study.job_config(grid, cell))
        assert cfg.rounds == (2 if cell.epsilon is None else grid.train_rounds + 2)


def test_floor_cell_has_no_fine_tuning_and_computes_the_ceiling(tmp_path: Path) -> None:
    cfg = study.job_config(QUICK, Cell("rotten_tomatoes", "iid", 0, 0.1, None))
    assert cfg["algo"]["train_rounds"] == 0 and cfg["algo"]["eval"]["references"]
    other = study.job_config(QUICK, Cell("rotten_tomatoes", "iid", 0, 0.5, math.inf))
    assert other["algo"]["epsilon_train"] == "inf" and not other["algo"]["eval"]["references"]
    assert other["clients"]["roles"]["strong"] == 0.5


def test_the_study_is_registered() -> None:
    load_studies()
    assert STUDIES.get("dpsyn") is study.STUDY


def test_time_estimate_scales_the_measured_runs(done: Any) -> None:
    out, _, _, _ = done
    res = study.read(open_study(study.STUDY, out, grid=TINY))
    est = study.estimate_seconds(TINY, res)
    measured = sum(r.wall_s for r in res.values())
    assert est is not None and est > 0
    profile = sum(r.stage_seconds()["profile"] for r in res.values())
    assert est == pytest.approx(measured - profile)  # same grid, same counts: exact
