"""Every FedAvg-family algorithm runs through the engine and learns; reports and listings work."""

from __future__ import annotations

import json
import sys

import pytest

from fedfm import cli
from fedfm.config import load_config
from fedfm.report import compare
from fedfm.runtime import run
from helpers import toy  # noqa: F401


def _run(tmp_path, name, algorithm, algo=None, rounds=6, **kw):
    cfg = {
        "name": name,
        "algorithm": algorithm,
        "algo": algo or {},
        "rounds": rounds,
        "task": {"kind": "toy"},
        "out_dir": str(tmp_path),
        "train": {"steps": 10, "batch_size": 8, "lr": 0.05},
        **kw,
    }
    return run(load_config(cfg), progress=False)


@pytest.mark.parametrize(
    ("algorithm", "algo"),
    [
        ("fedavg", {}),
        ("fedavg", {"server_opt": {"name": "fedavgm", "momentum": 0.5}}),
        ("fedavg", {"server_opt": {"name": "fedadagrad", "lr": 1.0}}),
        ("fedavg", {"server_opt": {"name": "fedadam", "lr": 0.1}}),
        ("fedavg", {"server_opt": {"name": "fedyogi", "lr": 0.1}}),
        ("fedprox", {"mu": 0.1}),
        ("scaffold", {}),
    ],
)
def test_algorithm_learns(tmp_path, algorithm, algo):
    summary = _run(tmp_path, "r", algorithm, algo, plots=False)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rmse"] < 0.5 * rows[0]["rmse"]  # round 0 is the untrained model
    assert summary["bytes_up"] > 0 and summary["failed_clients"] == 0


def test_scaffold_keeps_control_variates_in_client_state(tmp_path):
    from fedfm.core.checkpoint import latest_checkpoint, load_checkpoint

    _run(tmp_path, "s", "scaffold", rounds=2, plots=False)
    ck = load_checkpoint(latest_checkpoint(tmp_path / "s" / "checkpoints"))
    assert {k.split("::")[1] for k in ck.client_arrays} == {"control/weight", "control/bias"}
    audit = [json.loads(x) for x in (tmp_path / "s" / "audit.jsonl").read_text().splitlines()]
    assert {a["field"] for a in audit if a["direction"] == "up"} >= {"delta_y", "delta_c"}


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_update_norm_is_the_global_drift_from_the_start(tmp_path, algorithm):
    from fedfm.core.artefacts import split_state
    from fedfm.core.checkpoint import latest_checkpoint, load_checkpoint
    from fedfm.core.groups import get_group
    from fedfm.engine import build

    _run(tmp_path, "u", algorithm, rounds=3, plots=False)
    rows = [json.loads(x) for x in (tmp_path / "u" / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(str(tmp_path / "u" / "config.yaml"))
    start = build(cfg).algo.params  # θ_0: rebuilt from the run's seed
    ck = load_checkpoint(latest_checkpoint(tmp_path / "u" / "checkpoints"))
    end = get_group(split_state(ck.server_arrays)[0], "params")
    drift = sum(float(((end[k].double() - start[k].double()) ** 2).sum()) for k in start) ** 0.5
    assert rows[-1]["update_norm"] == pytest.approx(drift, rel=1e-9) and drift > 0
    assert "update_norm" not in rows[0]  # round 0 trains nothing
    assert all(r["update_norm"] > 0 for r in rows[1:])


def test_update_norm_by_hand():
    import torch

    from fedfm.core.aggregate import update_norm

    origin = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    moved = {"w": torch.tensor([4.0, 2.0]), "b": torch.tensor([-3.5])}
    assert update_norm(moved, origin) == pytest.approx(5.0)  # √(3² + 4²)
    assert update_norm(origin, origin) == 0.0
    with pytest.raises(ValueError, match="update_norm"):
        update_norm({"w": moved["w"]}, origin)


def test_local_only_shares_no_tensors(tmp_path):
    _run(tmp_path, "l", "local", rounds=2, plots=False)
    audit = [json.loads(x) for x in (tmp_path / "l" / "audit.jsonl").read_text().splitlines()]
    assert all(a["type"] == "meta" for a in audit)
    lines = (tmp_path / "l" / "client_metrics.jsonl").read_text().splitlines()
    per = [json.loads(x) for x in lines]
    assert set(per[-1]["clients"]) == {str(i) for i in range(6)}


def test_plots_report_and_list(tmp_path, monkeypatch, capsys):
    _run(tmp_path, "a", "fedavg", rounds=2)
    _run(tmp_path, "b", "fedprox", rounds=2)
    assert (tmp_path / "a" / "metrics.png").stat().st_size > 1000
    assert (tmp_path / "a" / "bytes.png").stat().st_size > 1000
    table = compare([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    lines = table.splitlines()
    assert lines[0].startswith("| run | algorithm | rounds | rmse") and len(lines) == 4
    assert (tmp_path / "cmp" / "compare.png").exists()
    monkeypatch.setattr(sys, "argv", ["fedfm", "list"])
    cli.main()  # returns normally on success
    out = capsys.readouterr().out
    for word in ("fedavg", "scaffold", "breast_cancer", "dirichlet", "tabular-fedavg", "mlp"):
        assert word in out
