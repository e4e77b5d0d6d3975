"""The headline's change since round 0, paired by item: arithmetic, and the run's last line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedfm.config import load_config
from fedfm.eval.compare import paired_change
from fedfm.eval.llm import reference_nll_means
from fedfm.progress import summary_line
from fedfm.runtime import run
from helpers.bases import FEDSDR
from helpers.config import make_config
from helpers.runfiles import jsonl_rows


def _row(rnd: int, values: dict[str, float | None], zeroshot: bool = False) -> dict:
    items = [
        {"id": k, "domain": "d", "zeroshot": zeroshot, "ref_nll": v} for k, v in values.items()
    ]
    return {"round": rnd, "items": items}


def test_paired_change_is_the_mean_and_se_of_per_item_differences():
    rows = [
        _row(0, {"a": 3.0, "b": 2.0, "c": 4.0, "gone": 9.0}),
        _row(1, {"a": 9.9}),  # a middle evaluation is not used
        _row(2, {"a": 2.0, "b": 1.5, "c": 2.0, "new": 0.0}),
    ]
    got = paired_change(rows, "ref_nll")
    # Differences -1.0, -0.5, -2.0: mean -7/6, sample SD of (1/6, 2/3, -5/6) = sqrt(7/12).
    assert got is not None
    assert got["mean"] == pytest.approx(-7 / 6)
    assert got["se"] == pytest.approx(math.sqrt(7 / 12) / math.sqrt(3))
    assert (got["n"], got["from_round"], got["to_round"]) == (3, 0, 2)


def test_paired_change_keeps_zeroshot_apart_and_refuses_non_item_means():
    rows = [_row(0, {"a": 1.0, "b": 2.0}, zeroshot=True), _row(1, {"a": 0.0, "b": 0.0}, True)]
    assert paired_change(rows, "ref_nll") is None  # no seen-domain items
    assert paired_change(rows, "zeroshot/ref_nll")["mean"] == pytest.approx(-1.5)
    assert paired_change(rows, "score") is None  # a mean over domains, not items
    assert paired_change(rows[:1], "zeroshot/ref_nll") is None


def test_reference_nll_means_weigh_items_not_tokens():
    items = [
        {"domain": "x", "ref_nll": 1.0},
        {"domain": "x", "ref_nll": 3.0},
        {"domain": "y", "ref_nll": 5.0},
        {"domain": "y"},  # not scored
    ]
    got = reference_nll_means(items)
    assert got["ref_nll"] == pytest.approx(3.0)
    assert got["ref_nll/x"] == pytest.approx(2.0) and got["ref_nll/y"] == pytest.approx(5.0)
    assert got["ref_nll_se"] == pytest.approx(2.0 / math.sqrt(3))


def test_a_run_headlined_by_reference_nll_ends_with_its_paired_change(tmp_path: Path):
    task = {
        **FEDSDR["task"],
        "eval_ppl": True,
        "likelihood_only": True,
        "choice_mode": "loglik",
        "primary": "ref_nll",
    }
    cfg = make_config(
        FEDSDR, tmp_path, name="nll", algorithm="fedavg", rounds=1, eval_before=True, task=task
    )
    summary = run(load_config(cfg), progress=False)
    change = summary["change"]
    assert (change["metric"], change["from_round"], change["to_round"]) == ("ref_nll", 0, 1)
    assert change["n"] == 6  # two test items of each of three domains
    rows = jsonl_rows(tmp_path / "nll" / "metrics.jsonl")
    assert summary["best"]["ref_nll"] == min(r["ref_nll"] for r in rows)  # lower is better
    line = summary_line(summary, tmp_path / "nll")
    assert f"paired over {change['n']} items" in line and line.startswith("nll: ref_nll=")
