"""The FedeKD study: validation split, statistics on hand-made numbers, the rule that picks
β and λ, curves from per-round client metrics, the jobs the rule's choice adds, and the
report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from sklearn.metrics import f1_score

import fedfm.algorithms.fedekd  # noqa: F401  (registers fedekd, fedkd-ungated, local-private)
from fedfm.config import load_config
from fedfm.engine import build, resolve
from fedfm.errors import ConfigError
from fedfm.reproduce import fedekd_skew as study
from fedfm.reproduce.fedekd_skew import STUDY
from fedfm.reproduce.framework import RunView, open_study, reproduce, write_report
from fedfm.reproduce.stats import Estimate, mean_se, paired, pooled_paired
from fedfm.runtime import run
from fedfm.tasks.base import macro_f1
from helpers.config import make_config

# The study's FedeKD setting, small: three rounds evaluated every second, a validation split.
STUDY_RUN: dict[str, Any] = {
    "seed": 0,
    "rounds": 3,
    "algorithm": "fedekd",
    "plots": False,
    "eval_every": 2,
    "algo": {"proxy_arch": {"hidden": [8]}, "private_archs": [{"hidden": [16]}]},
    "task": {
        "kind": "tabular",
        "dataset": "breast_cancer",
        "model_args": {"hidden": [16]},
        "local_test_fraction": 0.25,
        "local_val_fraction": 0.2,
    },
    "partition": {"scheme": "iid", "num_clients": 4},
    "train": {"steps": 1, "batch_size": 16, "optimizer": "adam", "lr": 0.01},
}


# ----------------------------------------------------------------------------- validation split


def _ids(data: Any) -> set[int]:
    return set(data.ids.tolist())


def test_validation_split_is_disjoint_from_training_and_test_rows(tmp_path):
    task = build(load_config(make_config(STUDY_RUN, tmp_path, name="v"))).task
    without = build(
        load_config(make_config(STUDY_RUN, tmp_path, name="v0", task={"local_val_fraction": 0.0}))
    ).task
    sizes = task.stats()["sizes"]
    for cid, size in zip(task.client_ids(), sizes, strict=True):
        train, test = _ids(task.client_data(cid)), _ids(task.client_test_data(cid))
        val = _ids(task.client_val_data(cid))
        assert not (train & val) and not (train & test) and not (val & test)
        assert len(train) + len(val) + len(test) == size
        assert len(val) == round(0.2 * size) and len(test) == round(0.25 * size)
        # Holding out validation rows takes them from training; the test rows stay as they were.
        assert test == _ids(without.client_test_data(cid))
        assert train | val == _ids(without.client_data(cid))
        assert len(without.client_val_data(cid)) == 0
    assert task.stats()["local_val_sizes"] == [
        len(task.client_val_data(c)) for c in task.client_ids()
    ]
    assert "local_val_sizes" not in without.stats()


def test_validation_fraction_leaving_no_training_rows_is_refused(tmp_path):
    cfg = load_config(
        make_config(
            STUDY_RUN,
            tmp_path,
            name="bad",
            task={"local_test_fraction": 0.5, "local_val_fraction": 0.5},
        )
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert err.value.field == "task.local_val_fraction"
    assert "leaves no training rows" in err.value.reason


# ----------------------------------------------------------------------------- curves


def test_clients_logged_every_eval_round_and_curves_read_per_split(tmp_path):
    run(load_config(make_config(STUDY_RUN, tmp_path, name="kd")), progress=False)
    run(
        load_config(make_config(STUDY_RUN, tmp_path, name="lp", algorithm="local-private")),
        progress=False,
    )
    avg = {
        **make_config(STUDY_RUN, tmp_path, name="avg", algorithm="fedavg"),
        "algo": {"personal_eval": True},
    }
    run(load_config(avg), progress=False)
    # Before training, then every 2 rounds, and the last round (always evaluated).
    rows = [
        json.loads(x) for x in (tmp_path / "kd" / "client_metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == [0, 2, 3]
    for split in ("test", "local", "val"):
        curve = study.client_curves(RunView(tmp_path / "kd"), split, "acc")
        assert sorted(curve) == [0, 2, 3] and sorted(curve[3]) == ["0", "1", "2", "3"]
        assert curve[3]["1"] == rows[-1]["clients"]["1"][f"{split}/acc"]
    # FedAvg: every client holds the global model, whose global-test value is in metrics.jsonl.
    glob = [json.loads(x) for x in (tmp_path / "avg" / "metrics.jsonl").read_text().splitlines()]
    avg = study.client_curves(RunView(tmp_path / "avg"), "test", "acc")
    assert sorted(avg) == [0, 2, 3]
    assert set(avg[3].values()) == {next(r["acc"] for r in glob if r["round"] == 3)}
    assert study.client_curves(RunView(tmp_path / "avg"), "val", "acc") == {}
    # Negative transfer against the local-only run, round by round.
    kd, lp = (study.client_curves(RunView(tmp_path / r), "val", "acc") for r in ("kd", "lp"))
    nt = study.nt_stats(kd[3], lp[3], True)
    per = [kd[3][c] - lp[3][c] for c in kd[3]]
    assert nt["nt_mean"] == pytest.approx(sum(per) / 4) and nt["nt_worst"] == min(per)
    assert nt["harmed"] == sum(v < 0 for v in per)


# ----------------------------------------------------------------------------- statistics


def test_macro_f1_equals_sklearn():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 30, (1,), generator=g))
        c = int(torch.randint(1, 6, (1,), generator=g))
        y = torch.randint(0, c, (n,), generator=g)
        pred = y.clone() if trial % 4 == 0 else torch.randint(0, c + 1, (n,), generator=g)
        want = f1_score(y.numpy(), pred.numpy(), average="macro", zero_division=0)
        assert macro_f1(pred, y) == pytest.approx(want, abs=1e-12)
    # By hand: class 0 TP 1, FP 1, FN 1: F1 = 2/4; class 1 TP 1, FN 1: F1 = 2/3; class 2 (only
    # predicted) F1 = 0; the mean is (1/2 + 2/3 + 0)/3 = 7/18.
    assert macro_f1(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 1, 0])) == pytest.approx(7 / 18)


def test_paired_and_pooled_differences_with_standard_errors_by_hand():
    a = {0: 1.0, 1: 2.0, 2: 4.0, 7: 9.0}  # seed 7 has no partner: left out
    b = {0: 0.0, 1: 1.0, 2: 1.0}
    est = paired(a, b)  # d = 1, 1, 3: mean 5/3, sd = sqrt((4/9+4/9+16/9)/2) = sqrt(4/3)
    assert est.n == 3 and est.mean == pytest.approx(5 / 3)
    assert est.se == pytest.approx(math.sqrt(4 / 3) / math.sqrt(3))
    assert est.fmt(2, signed=True) == "+1.67 ± 0.67" and est.resolved() == 1
    assert mean_se([2.0]).fmt() == "2.000" and math.isnan(mean_se([2.0]).se)
    assert mean_se([]).fmt() == "—" and Estimate(-1.0, 0.4, 3).resolved() == -1
    assert Estimate(0.5, 0.3, 3).resolved() == 0
    # Pooled: per seed the mean of the cells' differences, over the seeds every cell has.
    c2 = ({0: 0.0, 1: 0.0, 2: 1.0}, {0: 1.0, 1: 0.0, 2: 0.0})  # d = -1, 0, 1
    pooled = pooled_paired([(a, b), c2])  # per seed (1-1)/2, (1+0)/2, (3+1)/2 = 0, 0.5, 2
    assert pooled.n == 3 and pooled.mean == pytest.approx(2.5 / 3)
    assert pooled.se == pytest.approx(mean_se([0.0, 0.5, 2.0]).se)


def test_negative_transfer_sign_convention():
    nt = study.negative_transfer({"0": 0.9, "1": 0.7}, {"0": 0.8, "1": 0.75})
    assert nt["per_client"] == pytest.approx({"0": 0.1, "1": -0.05})
    assert nt["mean"] == pytest.approx(0.025) and nt["worst"] == pytest.approx(-0.05)
    # RMSE: lower is better, so a larger federated error is negative (harm).
    nt = study.negative_transfer({"0": 2.0, "1": 3.0}, {"0": 2.5, "1": 2.5}, higher_is_better=False)
    assert nt["per_client"] == {"0": 0.5, "1": -0.5} and nt["worst"] == -0.5
    with pytest.raises(ValueError, match="share no client"):
        study.negative_transfer({"0": 1.0}, {"1": 1.0})


def test_negative_transfer_stats_count_harmed_clients():
    mine, ref = {"0": 0.5, "1": 0.7, "2": 0.9}, {"0": 0.6, "1": 0.7, "2": 0.8}
    nt = study.nt_stats(mine, ref, higher_is_better=True)  # NT = -0.1, 0, +0.1
    assert nt["nt_mean"] == pytest.approx(0.0) and nt["nt_worst"] == pytest.approx(-0.1)
    assert nt["harmed"] == 1 and nt["clients"] == 3  # NT = 0 is not harm
    rmse = study.nt_stats(mine, ref, higher_is_better=False)  # lower error is better
    assert rmse["nt_worst"] == pytest.approx(-0.1) and rmse["harmed"] == 1


# ----------------------------------------------------------------------------- the rule


def test_rule_ranks_configurations_on_validation_and_breaks_ties():
    configs = [(1.0, 1.0), (4.0, 1.0), (2.0, 0.5)]
    cells = {
        ("a", "s"): {(1.0, 1.0): 0.0, (4.0, 1.0): 0.2, (2.0, 0.5): 0.1},  # ranks 3, 1, 2
        ("b", "s"): {(1.0, 1.0): 0.3, (4.0, 1.0): -0.1, (2.0, 0.5): 0.3},  # 1.5, 3, 1.5
        ("c", "s"): {(1.0, 1.0): 0.3},  # incomplete: left out
    }
    choice = study.choose_gate(configs, cells)
    assert choice.mean_rank == {(1.0, 1.0): 2.25, (4.0, 1.0): 2.0, (2.0, 0.5): 1.75}
    assert choice.gate == (2.0, 0.5) and choice.missing == [("c", "s")]
    tie = {("a", "s"): {(4.0, 1.0): 1.0, (2.0, 2.0): 1.0, (2.0, 0.5): 1.0}}
    assert study.choose_gate([(4.0, 1.0), (2.0, 2.0), (2.0, 0.5)], tie).gate == (2.0, 0.5)
    assert study.choose_gate(configs, {("c", "s"): {(1.0, 1.0): 0.3}}) is None


def test_jobs_name_every_gate_field_and_run_the_choice_after_the_grid(tmp_path):
    grid = study.Grid(
        presets=("fedekd-breast-cancer",),
        settings=(study.Setting(0.1, 4, 16),),
        control_settings=(study.Setting(5.0, 10),),
        seeds=(0, 1),
        betas=(1.0, 8.0),
        lams=(0.5, 1.0),
        long_presets=("fedekd-concrete",),
        long_seeds=(0,),
    )
    main = study.main_cells(grid)
    assert len(main) == 2 * (4 + 2 + 4) and main[0].seed == 0 and main[-1].seed == 1
    after = study.chosen_cells(grid, (8.0, 0.5))
    control = [j for j in after if not j.long]
    assert {j.variant.key for j in control} == {
        "local",
        "local-private",
        "fedavg",
        "fedprox",
        "fedkd-ungated-l0.5",
        "fedekd-b8-l0.5",
        "fedkd-ungated-l1",
        "fedekd-b1-l1",
    }
    long = [j for j in after if j.long]
    assert len(long) == 8 and long[0].name == "long-concrete-a0.5-k10-s0-local"
    cfg = study.job_config(main[-1], grid)  # FedeKD β = 8, λ = 1
    assert cfg["algo"]["beta"] == 8.0 and cfg["algo"]["lam"] == 1.0
    assert cfg["partition"]["alpha"] == 0.1 and cfg["partition"]["min_size"] == 16
    assert cfg["clients"]["min_clients"] == 4 and cfg["task"]["local_val_fraction"] == 0.15
    resolve(load_config(cfg))
    ung = next(j for j in main if j.variant.method == "fedkd-ungated")
    assert study.job_config(ung, grid)["algo"]["gate"] == "ungated"
    # The study lists the runs of the rule's choice only once the main grid has run.
    ctx = open_study(STUDY, tmp_path, grid=grid)
    assert [r.name for r in study.jobs(ctx)] == [c.name for c in main]
    ctx.done.update(c.name for c in main)
    more = [r.name for r in study.jobs(ctx)][len(main) :]
    assert more == [c.name for c in study.chosen_cells(grid, study.REFERENCE_GATE)]


# ----------------------------------------------------------------------------- the report

# Accuracy offset of each variant for clients 0, 1, 2 at seed s; the references have 0, so NT
# equals the offset. FedeKD β=4 beats β=1 on validation, so the rule picks (4, 1).
OFFSETS = {
    "local": lambda s: (0.0, 0.0, 0.0),
    "local-private": lambda s: (0.0, 0.0, 0.0),
    "fedavg": lambda s: (0.05, 0.05, 0.05),
    "fedprox": lambda s: (0.04, 0.05, 0.05),
    "fedkd-ungated-l1": lambda s: (-0.10, 0.0, 0.01 * s),
    "fedekd-b1-l1": lambda s: (-0.05, 0.0, 0.0),
    "fedekd-b4-l1": lambda s: (-0.02 - 0.01 * s, 0.01, 0.0),
}


def _fake_run(out: Path, job: study.Cell, rounds: list[int]) -> None:
    """A finished run folder with hand-made client metrics (the shape the engine writes)."""
    run = out / job.name
    run.mkdir(parents=True)
    reg = job.preset == "fedekd-concrete"
    off = OFFSETS[job.variant.key](job.seed)
    scale = {r: r / rounds[-1] for r in rounds}  # long runs: the offsets grow over rounds
    rows, glob = [], []
    for r in rounds:
        vals = [(10.0 - 100 * o * scale[r]) if reg else (0.8 + o * scale[r]) for o in off]
        names = ["rmse"] if reg else ["acc", "macro_f1"]
        splits = ["local"] if job.variant.method in ("fedavg", "fedprox") else study.SPLITS
        clients = {
            str(c): {f"{sp}/{m}": v for sp in splits for m in names} for c, v in enumerate(vals)
        }
        rows.append({"round": r, "clients": clients})
        glob.append({"round": r, **dict.fromkeys(names, vals[0])})
    (run / "client_metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in glob))
    summary = {"primary": "rmse" if reg else "acc", "rounds": rounds[-1]}
    (run / "summary.json").write_text(json.dumps(summary))
    sizes = {"sizes": [20, 30, 40], "local_test_sizes": [5, 8, 10], "local_val_sizes": [3, 4, 6]}
    sizes["test_size"] = 114
    (run / "partition.json").write_text(json.dumps(sizes))


def test_report_from_hand_made_runs_states_differences_with_standard_errors(tmp_path):
    grid = study.Grid(
        presets=("fedekd-breast-cancer", "fedekd-concrete"),
        settings=(study.Setting(0.5, 10),),
        control_settings=(study.Setting(5.0, 10),),
        seeds=(0, 1, 2),
        betas=(1.0, 4.0),
        lams=(1.0,),
        rounds=3,
        long_presets=("fedekd-concrete",),
        long_seeds=(0, 1, 2),
        long_rounds=6,
        long_eval_every=3,
    )
    out = tmp_path / "runs"
    for job in study.main_cells(grid):
        _fake_run(out, job, [3])
    ctx = open_study(STUDY, out, grid=grid, command="cmd")
    choice, gate = study.gate_of(ctx)
    assert choice is not None and gate == (4.0, 1.0)
    for job in study.chosen_cells(grid, gate):
        _fake_run(out, job, [3, 6] if job.long else [3])
    report = write_report(STUDY, ctx, tmp_path / "docs" / "fedekd_skew.md")
    text = report.read_text()
    assert "**Chosen: β = 4, λ = 1**" in text and "stops inside section 3.5" in text
    # FedeKD(4,1) − ungated(1), NT mean: d_s = (0.09 − 0.02 s)/3 = 0.03, 0.0233, 0.0167,
    # mean 0.0233, SE 0.00667/√3 = 0.0038; worst: d_s = 0.08 − 0.01 s, mean 0.07, SE 0.0058;
    # harmed: client 0 in both, Δ 0.
    row = "| breast-cancer | α=0.5, 10 clients | +0.023 ± 0.004 | +0.070 ± 0.006 | +0.0 ± 0.0 |"
    assert row in text
    assert "| concrete | α=0.5, 10 clients | +2.33 ± 0.38 | +7.00 ± 0.58 | +0.0 ± 0.0 |" in text
    assert "| breast-cancer | α=5, 10 clients | +0.023 ± 0.004 |" in text  # control cells
    assert "| Δ NT mean, global test | +0.023 ± 0.004 | a better (> 2 SE) |" in text
    # The readouts open the report, the gate against ungated KD first, with its verdict.
    first = text.split("## Readouts", 1)[1].splitlines()
    r1 = next(x for x in first if x.startswith("| R1 |"))
    assert "| +0.023 ± 0.004 |" in r1 and "in the paper's direction (> 2 SE)" in r1
    assert text.index("## Readouts") < text.index("## What the paper's text gives")
    # Long runs: at round 3 the offsets are half those at round 6.
    assert "| 3 | " in text and "| 6 | " in text and "+1.17 ± 0.19 |" in text
    assert "| breast-cancer | α=0.5, 10 clients | 20 / 30 | 5 / 8 | 3 / 4 | 114 |" in text
    for fig in ("negative_transfer.png", "gate_grid.png", "nt_curves.png"):
        assert (tmp_path / "docs" / "fedekd_skew" / fig).stat().st_size > 1000


def test_quick_study_writes_its_report_and_skips_finished_runs_on_rerun(tmp_path):
    report = reproduce("fedekd_skew", tmp_path, quick=True)
    assert isinstance(report, Path)
    text = report.read_text()
    assert report == tmp_path / "fedekd_skew-quick" / "fedekd_skew-quick.md"
    assert "fedfm reproduce fedekd_skew --quick" in text and "did not finish" not in text
    assert "**Chosen: β = " in text and "1 invocation(s) ran jobs" in text
    row = next(x for x in text.splitlines() if x.startswith("| α=0.5, 10 clients | FedeKD (β="))
    assert "—" not in row  # every statistic was computed
    # A second invocation finds every run done: it only rewrites the report.
    reproduce("fedekd_skew", tmp_path, quick=True)
    record = json.loads((tmp_path / "fedekd_skew-quick" / "study.json").read_text())
    assert [i["ran"] for i in record["invocations"]] == [40, 0]  # 28 main, then 12 long runs
    assert {j["status"] for j in record["jobs"].values()} == {"done"} and len(record["jobs"]) == 40
