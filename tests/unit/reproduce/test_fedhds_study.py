"""The FedHDS study runs its grid on a tiny Llama and reports what the runs measured."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedfm.reproduce import fedhds as study
from fedfm.reproduce.framework import open_study, run_study

TINY_TASK = {
    "model": "tiny-llama",
    "model_args": {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 8},
    "autocast_bf16": False,
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
    "prompt": {"max_length": 192, "max_prompt_length": 160},  # the Alpaca prompt, small vocab
}
TURBO = {"vocab": "small", "hidden": 16, "layers": 1, "heads": 2, "seed": 3}
GRID = study.Grid(
    40,  # three domains: 120 rows, as many as five of 24 held, so that FedHDS finds clusters
    4,
    5,
    1,
    heldout_tokens=4,
    math_tokens=4,
    clients=4,
    fraction=1.0,
    task=TINY_TASK,
    trained=study.OPEN,
    heldout=study.BASE_LM["heldout"],
    base_lm=True,
    eval_ppl=True,
    partition={"scheme": "iid", "min_size": 2},
    # tiny-model points have no density structure at two neighbours: one lets FedHDS select
    algo={"min_samples": 1, "server_min_samples": 1},
    turbo_model="tiny-llama",
    turbo_args=TURBO,
    gated=False,  # a tiny model learns nothing to resolve: run every method regardless
)


def _heldout(folder: Path, rnd: int | None = None) -> dict[str, float]:
    """Item id -> Rouge-L of the held-out items of one evaluation, read from the file."""
    rows = [json.loads(x) for x in (folder / "eval_items.jsonl").read_text().splitlines()]
    want = max(r["round"] for r in rows) if rnd is None else rnd
    items = next(r["items"] for r in rows if r["round"] == want)
    return {str(i["id"]): float(i["rougeL"]) for i in items if i.get("zeroshot")}


def _mean_se(d: list[float]) -> str:
    return f"{np.mean(d):+.3f} ± {np.std(d, ddof=1) / math.sqrt(len(d)):.3f}"


def _summary(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / "summary.json").read_text())
    return data


def test_grid_holds_out_a_category_and_reports_the_measured_readouts(tmp_path: Path) -> None:
    # The pilot alone first: FedIT's first seed, its round 0 the base; its page says so.
    ctx = open_study(study.STUDY, tmp_path, grid=GRID, command="pilot", pilot=True)
    page = run_study(study.STUDY, ctx, tmp_path / "pilot.md").read_text()
    assert not ctx.failed
    assert "The main grid has not run" in page and "## The premise pilot (R1, R2)" in page
    fedit = study.RunView(tmp_path / "fedit")
    before, after = study.item_scores(fedit, True, 0), study.item_scores(fedit, True)
    d_pilot = [after[i] - before[i] for i in sorted(before)]
    r1 = next(x for x in page.splitlines() if x.startswith("| R1 |"))
    assert f"| {_mean_se(d_pilot)} |" in r1
    ctx = open_study(study.STUDY, tmp_path, grid=GRID, command="cmd")
    text = run_study(study.STUDY, ctx, tmp_path / "r.md").read_text()
    names = ["fedit", "probe", "fedit-s1", "fedhds", "fedhds-s1", "turbo", "random", "count"]
    record = json.loads((tmp_path / "study.json").read_text())
    assert sorted(record["jobs"]) == sorted(names)
    errors = {n: j.get("error") for n, j in record["jobs"].items() if j["status"] != "done"}
    assert not errors
    cfgs = {n: yaml.safe_load((tmp_path / n / "config.yaml").read_text()) for n in names}
    assert all(c["task"]["heldout_domains"] == [GRID.heldout] for c in cfgs.values())
    assert cfgs["fedit-s1"]["seed"] == 1 and cfgs["fedit"]["seed"] == 0
    assert [n for n in names if cfgs[n]["eval_before"]] == ["fedit"]  # the base, once
    assert cfgs["turbo"]["algo"]["feature_model"] == "tiny-llama"
    assert (cfgs["count"]["algo"]["min_samples"], cfgs["fedhds"]["algo"]["min_samples"]) == (1, 1)
    # Random ran after FedHDS, at the data fraction FedHDS measured.
    hds = _summary(tmp_path / "fedhds")
    assert cfgs["random"]["algo"]["random_budget"] == round(hds["finish"]["data_fraction"], 6)
    assert record["jobs"]["random"]["needs"] == ["fedit", "probe", "fedhds"]
    assert record["jobs"]["fedit-s1"]["needs"] == ["fedit", "probe"]  # the whole pilot
    assert cfgs["probe"]["rounds"] == 1 and cfgs["fedhds"]["rounds"] == GRID.rounds
    probe = study.RunView(tmp_path / "probe")
    stats = study._selection_stats(probe)
    row = f"| {stats['rows per client']:.1f} | {stats['clusters per client']:.1f} |"
    assert row in page  # the probe's selection, in the pilot's page
    # Only the held-out domain is scored zero-shot, and no client trained on it.
    items = [
        json.loads(x) for x in (tmp_path / "fedit" / "eval_items.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in items] == [0, 1]
    held = {i["domain"] for r in items for i in r["items"] if i["zeroshot"]}
    assert held == {GRID.heldout} and len(_heldout(tmp_path / "fedit")) == GRID.heldout_items
    part = json.loads((tmp_path / "fedit" / "partition.json").read_text())
    assert sorted(part["labels"]) == sorted(study.OPEN)
    assert part["heldout_domains"] == [GRID.heldout]
    assert all(c["task"]["prompt"]["use_chat_template"] is False for c in cfgs.values())
    held_nll = study.heldout_nll(study.RunView(tmp_path / "fedit"))
    assert len(held_nll) == GRID.heldout_items  # the held-out references' NLL beside Rouge-L
    # The readouts come first; R1 pairs items after averaging each over the two seeds.
    assert text.index("## Readouts") < text.index("## Setup") < text.index("## The instrument")
    mine = [_heldout(tmp_path / n) for n in ("fedhds", "fedhds-s1")]
    ref = [_heldout(tmp_path / n) for n in ("fedit", "fedit-s1")]
    d = [
        float(np.mean([m[i] for m in mine]) - np.mean([r[i] for r in ref])) for i in sorted(ref[0])
    ]
    r3 = next(x for x in text.splitlines() if x.startswith("| R3 |"))
    assert f"| {_mean_se(d)} |" in r3
    rnd = _heldout(tmp_path / "random")
    r4 = next(x for x in text.splitlines() if x.startswith("| R4 |"))
    assert f"| {_mean_se([mine[0][i] - rnd[i] for i in sorted(rnd)])} |" in r4
    # R3: FedIT's client training seconds over FedHDS's, per seed, mean ± SE over seeds.
    ratios = [
        _summary(tmp_path / a)["finish"]["total_train_s"]
        / _summary(tmp_path / b)["finish"]["total_train_s"]
        for a, b in (("fedit", "fedhds"), ("fedit-s1", "fedhds-s1"))
    ]
    r5 = next(x for x in text.splitlines() if x.startswith("| R5 |"))
    se = np.std(ratios, ddof=1) / math.sqrt(2)
    assert f"| {np.mean(ratios):.1f} ± {se:.1f} |" in r5
    # The base row is FedIT's round 0; the data fraction before and after the fix is shown.
    base = np.mean(list(_heldout(tmp_path / "fedit", 0).values()))
    assert f"| untrained base (round 0) | {base:.3f} |" in text
    count = _summary(tmp_path / "count")["finish"]["data_fraction"]
    assert f"| before (sklearn's count) | {count:.4f} |" in text
    assert "R1 per seed" in text and "## Not run" not in text
    # A second invocation runs nothing again.
    again = open_study(study.STUDY, tmp_path, grid=GRID, command="cmd")
    run_study(study.STUDY, again, tmp_path / "r.md")
    record = json.loads((tmp_path / "study.json").read_text())
    assert [i["ran"] for i in record["invocations"]] == [2, 6, 0]


def test_readouts_cannot_be_tested_when_fedhds_selected_no_row() -> None:
    class View:  # what a readout reads of a finished run
        def __init__(self, fraction: float) -> None:
            self.finish = {"data_fraction": fraction}

    grid = study.Grid(4, 4, 4, 1)
    none = study.Results({"fedhds": View(0.0), "fedhds-s1": View(0.02)}, grid)  # type: ignore[dict-item]
    some = study.Results({"fedhds": View(0.02), "fedhds-s1": View(0.0)}, grid)  # type: ignore[dict-item]
    assert not study.selected(none) and study.selected(some)
    for r in study.readouts(grid)[4:]:
        assert r.testable is study.selected


def test_the_full_grid_tunes_a_base_lm_on_open_ended_data_and_waits_for_its_pilot(
    tmp_path: Path,
) -> None:
    from fedfm.config import load_config

    cfg = load_config(study.job_config(study.METHODS[1], study.FULL, 0))
    task = cfg.task if isinstance(cfg.task, dict) else cfg.task.model_dump()
    assert task["prompt"]["use_chat_template"] is False and task["eval_ppl"] is True
    # Open-ended categories only, one held out: GSM8K and two Alpaca categories trained.
    assert task["train_domains"] == ["math", "alpaca_qa", "alpaca_task"]
    assert task["heldout_domains"] == ["alpaca_creative"]
    source = task["source_options"]
    assert source["per_domain_test"] == {
        "math": 11, "alpaca_qa": 11, "alpaca_task": 11, "alpaca_creative": 90
    }  # fmt: skip
    assert task["domain_max_new_tokens"] == {"math": 160, "alpaca_qa": 160, "alpaca_task": 160}
    # Clients of about 60 rows, for HDBSCAN to find clusters: 5 rounds of 5 of 10 clients.
    assert (cfg.rounds, cfg.partition["num_clients"], cfg.clients.fraction) == (5, 10, 0.5)
    assert source["per_domain_train"] * 3 // 10 == 60

    class View:  # FedIT's items: round 0 (the base) and after training
        def __init__(self, gain: float) -> None:
            self.gain = gain

        def items(self, rnd: int | None = None) -> list[dict[str, Any]]:
            up = 0.0 if rnd == 0 else self.gain
            return [
                {"id": i, "zeroshot": True, "rougeL": 0.2 + up + 0.01 * (i % 3)} for i in range(9)
            ]

    needs = {"fedit": View(0.0)}
    build = study.job_config(study.METHODS[1], study.FULL, 0)
    with pytest.raises(study.Unmet, match="does not resolve FedIT above the base"):
        study._after_pilot(build, study.FULL, needs)  # type: ignore[arg-type]
    got = study._after_pilot(build, study.FULL, {"fedit": View(0.05)})  # type: ignore[arg-type]
    assert got == build

    class Probe:  # FedHDS's first round: its coreset, no selection log
        def __init__(self, coreset: float) -> None:
            self.finish, self.folder = {"total_coreset": coreset}, tmp_path

    few = {"fedit": View(0.05), "probe": Probe(3.0)}  # 3 rows x 5 rounds = 15 < 20
    with pytest.raises(study.Unmet, match="on course for 15 rows over 5 rounds"):
        study._after_pilot(build, study.FULL, few)  # type: ignore[arg-type]
    enough = {"fedit": View(0.05), "probe": Probe(4.0)}  # 20 rows
    assert study._after_pilot(build, study.FULL, enough) == build  # type: ignore[arg-type]
