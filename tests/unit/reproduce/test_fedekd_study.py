"""The FedeKD concept-shift study: the label-swap shift, the level and oracle gates, and the
study's grid run at tiny size through the framework, one readout checked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fedfm.algorithms.fedekd  # noqa: F401  (registers fedekd and local-private)
from fedfm.config import load_config
from fedfm.core.kd import GATES, GateContext, gated_kd
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.reproduce import fedekd as study
from fedfm.reproduce.framework import open_study, run_study
from helpers.config import make_config

SHIFT = {"name": "label-swap", "clients": [0], "pairs": [[1, 7], [3, 8]]}
# The study's preset made tiny: 8x8 digits over 4 clients, two rounds of one step.
TINY: dict[str, Any] = {
    "rounds": 2,
    "eval_every": 1,
    "algo": {"proxy_arch": {"width": 2, "hidden": 8}, "private_archs": [{"width": 2, "hidden": 8}]},
    "task": {"dataset": "digits", "model_args": {"width": 2, "hidden": 8}, "shift": SHIFT},
    "partition": {"scheme": "iid", "num_clients": 4, "min_size": 2},
    "clients": {"min_clients": 4},
    "train": {"steps": 1, "batch_size": 16},
}
RUN: dict[str, Any] = {
    "seed": 0,
    "rounds": 1,
    "algorithm": "local-private",
    "plots": False,
    "task": {
        "kind": "image",
        "dataset": "digits",
        "model": "small-cnn",
        "shift": SHIFT,
        "local_test_fraction": 0.25,
    },
    "partition": {"scheme": "iid", "num_clients": 4},
    "train": {"steps": 1, "batch_size": 16},
}


def test_label_swap_relabels_exactly_the_pairs_on_the_shifted_clients(tmp_path):
    task = build(load_config(make_config(RUN, tmp_path, name="s"))).task
    plain = build(
        load_config(make_config(RUN, tmp_path, name="p", task={"shift": {"name": "none"}}))
    ).task
    swap = {1: 7, 7: 1, 3: 8, 8: 3}
    for cid in task.client_ids():
        for split in ("client_data", "client_test_data"):
            y, y0 = getattr(task, split)(cid).y, getattr(plain, split)(cid).y
            want = y0.clone().apply_(lambda v: swap.get(v, v)) if cid == "0" else y0
            assert torch.equal(y, want)
    assert torch.equal(task.test_data().y, plain.test_data().y)
    assert task.shifted("0") == frozenset({1, 3, 7, 8}) and task.shifted("1") == frozenset()
    rel = task.relabelled("0", task.client_test_data("0"))
    assert set(rel.y.tolist()) <= {1, 3, 7, 8} and task.relabelled("1", rel) is None


@pytest.mark.parametrize(
    ("shift", "field"),
    [
        ({"clients": [9]}, "task.shift.clients"),
        ({"pairs": [[1, 12]]}, "task.shift.pairs"),
        ({"name": "rotate"}, "task.shift.name"),
    ],
)
def test_bad_shift_names_its_field(tmp_path, shift, field):
    with pytest.raises(ConfigError) as err:
        build(load_config(make_config(RUN, tmp_path, name="b", task={"shift": {**SHIFT, **shift}})))
    assert err.value.field == field


def test_level_gate_uses_a_running_mean_and_normalises_by_batch_size():
    ctx = GateContext()
    e1, d = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 4.0])
    loss, w = gated_kd(d, e1, "level", 1.0, ctx)
    assert ctx.level == 2.0  # first batch: its own mean
    assert torch.allclose(w, torch.exp(-e1 / 2.0))
    assert math.isclose(float(loss), float((w * d).sum() / 2), rel_tol=1e-6)
    # A whole batch above the running level gets less total weight (Σw·D / Σw could not).
    _, w2 = gated_kd(d, torch.tensor([6.0, 6.0]), "level", 1.0, ctx)
    assert ctx.level == pytest.approx(0.9 * 2.0 + 0.1 * 6.0)
    assert float(w2.mean()) < float(w.mean())


def test_oracle_gate_drops_exactly_the_unreliable_rows():
    ctx = GateContext(unreliable=torch.tensor([True, False, False]))
    loss, w = gated_kd(torch.tensor([9.0, 1.0, 2.0]), torch.zeros(3), "oracle", 0.0, ctx)
    assert w.tolist() == [0.0, 1.0, 1.0] and float(loss) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mask"):
        GATES.get("oracle")(torch.zeros(2), 1.0, GateContext())


def test_oracle_gate_without_a_shift_is_refused(tmp_path):
    cfg = make_config(
        RUN,
        tmp_path,
        name="o",
        algorithm="fedekd",
        algo={"gate": "oracle"},
        task={"shift": {"name": "none"}},
    )
    with pytest.raises(ConfigError) as err:
        build(load_config(cfg))
    assert err.value.field == "algo.gate"


def _local_acc(folder: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (folder / "client_metrics.jsonl").read_text().splitlines()]
    return {c: m["local/acc"] for c, m in rows[-1]["clients"].items()}


@pytest.mark.slow
def test_tiny_grid_through_the_framework_and_the_premise_by_hand(tmp_path):
    grid = study.Grid(
        "fedekd-fmnist-shift", seeds=(0, 1), lams=(1.0,), betas=(2.0,), overrides=TINY
    )
    ctx = open_study(study.STUDY, tmp_path / "s", grid=grid, workers=1)
    report = run_study(study.STUDY, ctx, tmp_path / "report.md")
    record = json.loads((tmp_path / "s" / "study.json").read_text())
    assert len(record["jobs"]) == 2 * 5 and {j["status"] for j in record["jobs"].values()} == {
        "done"
    }
    # R1 by hand: ungated − local on client 0 (the only shifted one), per seed, mean ± SE.
    d = [
        _local_acc(tmp_path / "s" / f"ungated-l1-s{s}")["0"]
        - _local_acc(tmp_path / "s" / f"local-s{s}")["0"]
        for s in (0, 1)
    ]
    mean, se = (d[0] + d[1]) / 2, abs(d[0] - d[1]) / 2  # sd/√2 with ddof 1 for two values
    est = study.premise(study.read(ctx))
    assert est.n == 2 and est.mean == pytest.approx(mean) and est.se == pytest.approx(se)
    text = report.read_text()
    assert "premise: ungated KD (λ=1)" in text and "oracle gate (λ=1)" in text
    # The oracle's weights: 0 on every relabelled row, 1 on the others.
    w = study.read(ctx).weights["oracle-l1"]
    assert all(v == (0.0, 1.0) for v in w.values())
