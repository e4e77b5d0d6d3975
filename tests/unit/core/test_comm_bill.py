"""The communication bill: GB up and down per client and for the run, from the ledger."""

from __future__ import annotations

import json

import pytest

from fedfm.config import load_config
from fedfm.core.audit import communication_bill
from fedfm.html_report import write_run_report
from fedfm.report import compare
from fedfm.runtime import run
from helpers.config import toy_config


def test_bill_by_hand() -> None:
    rows = [
        {"client": "a", "direction": "up", "bytes": 1_000},
        {"client": "a", "direction": "down", "bytes": 3_000},
        {"client": "b", "direction": "up", "bytes": 500},
    ]
    bill = communication_bill(rows)
    assert bill["gb_up"] == pytest.approx(1.5e-6) and bill["gb_down"] == pytest.approx(3e-6)
    assert bill["gb_total"] == pytest.approx(4.5e-6)
    assert bill["per_client"] == {
        "a": {"gb_up": 1e-6, "gb_down": 3e-6},
        "b": {"gb_up": 5e-7, "gb_down": 0.0},
    }


def test_every_run_summary_report_and_page_give_the_bill(tmp_path) -> None:
    cfg = load_config(toy_config(tmp_path, name="r", rounds=2, comm={"uplink": "int8"}))
    summary = run(cfg, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "r" / "audit.jsonl").read_text().splitlines()]
    up = sum(r["bytes"] for r in rows if r["direction"] == "up")
    assert summary["comm"]["gb_up"] == pytest.approx(up / 1e9)
    assert summary["comm"]["gb_up"] == pytest.approx(summary["bytes_up"] / 1e9)
    per = summary["comm"]["per_client"]
    assert len(per) == 4
    assert sum(v["gb_down"] for v in per.values()) == pytest.approx(summary["comm"]["gb_down"])
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["comm"] == summary["comm"]
    table = compare([tmp_path / "r"], tmp_path / "cmp")
    assert "GB up" in table and f"| {summary['comm']['gb_up']:.6f} |" in table
    written = (tmp_path / "cmp" / "bill.md").read_text()
    assert f"| r | all | {summary['comm']['gb_up']:.6f} |" in written
    assert written.count("| r | ") == 4 + 1  # each client, all clients
    page = write_run_report(tmp_path / "r", summary)
    assert "communication bill" in page.read_text()
