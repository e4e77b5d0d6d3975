"""A run killed with SIGKILL mid-run and resumed ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedfm.config import load_config
from fedfm.runtime import run
from helpers.config import make_config, toy_config
from helpers.runs import kill_mid_run

# Twelve rounds of long local training with FedAdam: a run long enough to kill mid-way.
LONG: dict[str, Any] = toy_config(
    "runs",
    name="long",
    rounds=12,
    num_clients=6,
    algo={"server_opt": {"name": "fedadam", "lr": 0.05}},
    clients={"fraction": 0.5},
    train={"steps": 150, "lr": 0.02, "optimizer": "adam"},
)


def _metrics(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("time_s")
    return rows


def test_kill_9_then_resume_is_bit_identical(tmp_path):
    from helpers import toy  # noqa: F401

    run(load_config(make_config(LONG, tmp_path, name="straight")), progress=False)
    kill_mid_run(make_config(LONG, tmp_path, name="killed"), tmp_path / "killed")
    assert not (tmp_path / "killed" / "summary.json").exists()
    done = len(_metrics(tmp_path / "killed"))
    assert 4 <= done < 13

    run(load_config(make_config(LONG, tmp_path, name="killed")), resume=True, progress=False)
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "killed")
    assert straight == resumed  # every round, every metric, exactly
    a = json.loads((tmp_path / "straight" / "summary.json").read_text())["final"]
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())["final"]
    assert a == b
    # The audit ledger holds each round exactly once after the resume.
    audit = [json.loads(x) for x in (tmp_path / "killed" / "audit.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "straight" / "audit.jsonl").read_text().splitlines()]
    assert audit == ref
