"""The first runnable example: FedAvg beats the mean local-only client on breast cancer."""

from __future__ import annotations

import json

from fedfm.runtime import run


def test_tabular_fedavg_beats_local_only(tmp_path):
    common = [f"out_dir={tmp_path}", "plots=false"]
    fed = run("tabular-fedavg", common, progress=False)
    loc = run("tabular-local", common, progress=False)
    fed_acc, loc_acc = fed["final"]["acc"], loc["final"]["test/acc"]
    assert fed_acc > loc_acc, (fed_acc, loc_acc)
    stats = json.loads((tmp_path / "tabular-fedavg" / "partition.json").read_text())
    assert len(stats["sizes"]) == 10 and len(stats["label_hist"]) == 10
    assert (tmp_path / "tabular-local" / "client_metrics.jsonl").exists()
