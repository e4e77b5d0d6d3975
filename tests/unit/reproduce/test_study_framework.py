"""The study framework on a toy study of three jobs on a tiny tabular model: a run, a run
whose config takes a value the first one measured, and a computation over both; skip of
finished jobs, resume after a worker is killed mid-run, ``--dry-run``'s job list, the report
with its readouts, and the paired statistics against hand arithmetic."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from fedfm.errors import ConfigError
from fedfm.reproduce import stats
from fedfm.reproduce.framework import (
    Compute,
    Context,
    Readout,
    Run,
    RunView,
    Study,
    Unmet,
    check_part,
    dry_run,
    merge,
    open_study,
    run_jobs,
    run_status,
    run_study,
)
from fedfm.reproduce.stats import Estimate, macro_f1_diff, mean_of, paired, verdict
from fedfm.tasks.base import macro_f1
from helpers.cli import run_cli
from helpers.config import make_config

# The toy study's runs: FedAvg on breast cancer, three IID clients.
STUDY_RUN: dict[str, Any] = {
    "seed": 0,
    "rounds": 2,
    "algorithm": "fedavg",
    "plots": False,
    "task": {"kind": "tabular", "dataset": "breast_cancer", "model_args": {"hidden": [8]}},
    "partition": {"scheme": "iid", "num_clients": 3},
    "train": {"steps": 2, "batch_size": 16, "optimizer": "adam", "lr": 0.01},
}


def _lr(a: RunView) -> float:
    """B's learning rate, from A's measured final loss."""
    return round(0.001 * (1.0 + float(a.final["loss"])), 8)


def difference(inputs: Mapping[str, Path], folder: Path, metric: str) -> dict[str, Any]:
    """The toy computation: B's final ``metric`` minus A's (pure post-processing)."""
    a, b = (RunView(inputs[k]).final[metric] for k in ("a", "b"))
    return {"diff": b - a, "folder": folder.name}


def _b_config(rounds: int) -> Any:
    def config(needs: Mapping[str, RunView]) -> dict[str, Any]:
        if "loss" not in needs["a"].final:
            raise Unmet("A measured no loss")
        return make_config(STUDY_RUN, rounds=rounds, train__lr=_lr(needs["a"]))

    return config


def toy_jobs(ctx: Context[dict[str, Any]]) -> list[Any]:
    rounds, steps = ctx.grid["rounds"], ctx.grid.get("steps", 2)
    jobs: list[Any] = [
        Run("a", make_config(STUDY_RUN, rounds=rounds, train__steps=steps), group="train")
    ]
    jobs += (
        [
            Run(
                "a2",
                make_config(STUDY_RUN, rounds=rounds, train__lr=0.02, train__steps=steps),
                group="train",
            )
        ]
        if ctx.grid.get("a2")
        else []
    )
    return [
        *jobs,
        Run("b", _b_config(rounds), needs=("a",), group="train"),
        Compute("c", difference, {"metric": "acc"}, needs=("a", "b")),
    ]


def _read(ctx: Context[Any]) -> dict[str, Any]:
    return ctx.run("c").result or {}


TOY: Study[Any, Any] = Study(
    name="toy",
    summary="three jobs",
    full={"rounds": 2},
    quick={"rounds": 2},
    jobs=toy_jobs,
    read=_read,
    readouts=lambda grid: [
        Readout(
            "B − A, accuracy",
            "one run each",
            "B above A",
            +1,
            lambda r: Estimate(r["diff"], math.nan, 1) if r else stats.NONE,
        )
    ],
    title=lambda ctx: "Toy study",
    body=lambda ctx, r: ["## Body", "", f"diff {r.get('diff')}", ""],
    reports=("toy.md", None),
)


def _mtimes(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_jobs_run_in_dependency_order_record_study_json_and_skip_when_done(tmp_path):
    ctx = open_study(TOY, tmp_path / "toy", grid={"rounds": 2})
    report = run_study(TOY, ctx, tmp_path / "toy.md")
    a, b = RunView(tmp_path / "toy" / "a"), RunView(tmp_path / "toy" / "b")
    # A's measured loss reached B's config; C computed from both.
    assert b.config["train"]["lr"] == _lr(a) and b.config["threads"] == 1
    c = json.loads((tmp_path / "toy" / "c" / "result.json").read_text())
    assert c["result"]["diff"] == pytest.approx(b.final["acc"] - a.final["acc"])
    assert c["params"] == {"metric": "acc"}
    record = json.loads((tmp_path / "toy" / "study.json").read_text())
    assert [record["jobs"][n]["status"] for n in "abc"] == ["done"] * 3
    assert record["jobs"]["b"]["needs"] == ["a"] and record["jobs"]["c"]["kind"] == "compute"
    for n in "abc":
        e = record["jobs"][n]
        assert e["attempts"] == 1 and e["wall_s"] > 0 and e["cpu_s"] >= 0
        assert math.isfinite(e["load_start"]) and e["pid"] == os.getpid()
    (inv,) = record["invocations"]
    assert inv["ran"] == 3 and inv["failed"] == 0 and len(inv["load_end"]) == 3
    # The report: title, readouts first with the verdict, the study's body, the jobs' times.
    text = report.read_text()
    assert text.startswith("# Toy study\n")
    assert text.index("## Readouts") < text.index("## Body") < text.index("## Jobs, time and load")
    r1 = next(x for x in text.splitlines() if x.startswith("| R1 |"))
    assert "B − A, accuracy" in r1 and "no SE (one value" in r1
    # A second invocation finds every job done: nothing is touched.
    before = _mtimes(tmp_path / "toy" / "a") | _mtimes(tmp_path / "toy" / "c")
    again = open_study(TOY, tmp_path / "toy", grid={"rounds": 2})
    run_jobs(TOY, again)
    assert again.done == {"a", "b", "c"} and not again.failed
    assert before == _mtimes(tmp_path / "toy" / "a") | _mtimes(tmp_path / "toy" / "c")
    record = json.loads((tmp_path / "toy" / "study.json").read_text())
    assert [i["ran"] for i in record["invocations"]] == [3, 0]


def test_a_saved_config_without_a_field_added_since_is_still_done(tmp_path):
    run_jobs(TOY, open_study(TOY, tmp_path, grid={"rounds": 2}))
    cfg = {**make_config(STUDY_RUN, rounds=2), "name": "a", "out_dir": str(tmp_path), "threads": 1}
    assert run_status(cfg) == "done"
    saved = tmp_path / "a" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    del old["privacy"]["secagg"]["dp_noise"]  # as a run written before the field existed
    saved.write_text(yaml.safe_dump(old))
    assert run_status(cfg) == "done"  # read at its default
    old["privacy"]["secagg"]["dp_noise"] = "continuous"  # not the default: another config
    saved.write_text(yaml.safe_dump(old))
    assert run_status(cfg) == "changed"


def test_a_changed_need_reruns_its_dependents_and_an_unmet_need_skips(tmp_path):
    run_jobs(TOY, open_study(TOY, tmp_path, grid={"rounds": 2}))
    # One more round for every run: A and B are other configs (run afresh), C's inputs changed.
    ctx = open_study(TOY, tmp_path, grid={"rounds": 3})
    assert (
        run_status({**make_config(STUDY_RUN, rounds=3), "name": "a", "out_dir": str(tmp_path)})
        == "changed"
    )
    run_jobs(TOY, ctx)
    assert ctx.record.invocations[-1]["ran"] == 3
    assert RunView(tmp_path / "b").summary["rounds"] == 3  # type: ignore[index]
    # A need that does not allow the job: skipped with the reason, its dependents too.
    broken = dataclasses.replace(TOY, jobs=_unmet_jobs)
    ctx = open_study(broken, tmp_path / "broken", grid={"rounds": 2})
    run_jobs(broken, ctx)
    assert ctx.failed == {
        "b": "skipped: A measured no loss",
        "c": "skipped: needs b, which did not finish (skipped: A measured no loss)",
    }
    entry = ctx.record.jobs["b"]
    assert entry["status"] == "skipped" and entry["error"] == "A measured no loss"


def _unmet_jobs(ctx: Context[Any]) -> list[Any]:
    def config(needs: Mapping[str, RunView]) -> dict[str, Any]:
        raise Unmet("A measured no loss")

    jobs = toy_jobs(ctx)
    return [jobs[0], Run("b", config, needs=("a",)), jobs[-1]]


def test_dry_run_lists_the_jobs_and_estimates_from_measured_times(tmp_path, monkeypatch, capsys):
    ctx = open_study(TOY, tmp_path / "toy", grid={"rounds": 2})
    lines = dry_run(TOY, ctx)
    assert not (tmp_path / "toy").exists()  # nothing written
    rows = {x.split(" | ")[0].strip("| "): x for x in lines if x.startswith("| ")}
    assert "new: runs" in rows["a"] and "after a (configured from its measured values)" in rows["b"]
    assert "| a, b | after a |" in rows["c"] and rows["c"].endswith("| — |")  # no measurement
    assert lines[-1].startswith("3 jobs, 0 done or skipped, 3 to run: no estimate")
    run_jobs(TOY, ctx)
    # B to run again (its summary gone): its own measured time; D, never run: its group's.
    ctx = open_study(TOY, tmp_path / "toy", grid={"rounds": 2})
    walls = {n: e["wall_s"] for n, e in ctx.record.jobs.items()}
    (tmp_path / "toy" / "b" / "summary.json").unlink()
    more = dataclasses.replace(
        TOY,
        jobs=lambda c: [*toy_jobs(c), Run("d", make_config(STUDY_RUN, rounds=3), group="train")],
    )
    lines = dry_run(more, ctx)
    rows = {x.split(" | ")[0].strip("| "): x for x in lines if x.startswith("| ")}
    assert "done (skipped)" in rows["a"] and "partial: resumes" in rows["b"]
    assert rows["b"].endswith(f"| {walls['b']:.0f} |") and rows["d"].endswith(
        f"| {walls['a']:.0f} |"
    )
    total = (walls["b"] + walls["c"] + walls["a"]) / 60
    assert f"3 to run with 1 worker(s): about {total:.1f} min" in lines[-1]
    # Through the command line: the FedHDS quick grid, listed, nothing written.
    argv = ["reproduce", "fedhds", "--quick", "--dry-run", "--out", str(tmp_path / "r")]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    # The pilot (FedIT and FedHDS's first round) first: every other job waits for it.
    assert code == 0 and "| random | run | fedit, probe, fedhds | after fedit" in out, err
    assert "6 jobs, 0 done or skipped, 6 to run" in out and not (tmp_path / "r").exists()
    assert run_cli(["reproduce", "fedhds", "--jobs", "0"], monkeypatch, capsys)[0] == 2


def _kill_when_running(folder: Path, name: str, rows: int) -> threading.Thread:
    """Kills (SIGKILL) the worker running job ``name`` once its run has logged ``rows``."""

    def watch() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                entry = json.loads((folder / "study.json").read_text())["jobs"].get(name, {})
            except (OSError, json.JSONDecodeError):
                entry = {}
            metrics = folder / name / "metrics.jsonl"
            done = metrics.exists() and len(metrics.read_text().splitlines()) >= rows
            if entry.get("status") == "running" and entry.get("pid") != os.getpid() and done:
                os.kill(entry["pid"], signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time_s"} for r in rows]


def test_a_worker_killed_mid_run_is_resumed_by_the_next_invocation_to_equal_results(tmp_path):
    grid = {"rounds": 8, "steps": 20, "a2": True}
    folder = tmp_path / "killed"
    watcher = _kill_when_running(folder, "a", rows=3)
    ctx = open_study(TOY, folder, grid=grid, workers=2)
    run_jobs(TOY, ctx)  # A and A2 in worker processes; A's worker is killed
    watcher.join(timeout=1)
    assert ctx.failed["a"] == "interrupted: a worker process died"
    assert ctx.record.jobs["a"]["status"] == "interrupted"
    assert "b" not in ctx.done and not (folder / "a" / "summary.json").exists()
    assert 3 <= len(_rows(folder / "a")) < 9
    logged = (folder / "a" / "metrics.jsonl").read_text().splitlines()[:2]  # rounds 0 and 1
    again = open_study(TOY, folder, grid=grid)
    run_jobs(TOY, again)  # resumes A from its checkpoint, then B and C
    # Resumed, not run afresh: the rounds before the kill keep their logged times too.
    assert (folder / "a" / "metrics.jsonl").read_text().splitlines()[:2] == logged
    assert again.done == {"a", "a2", "b", "c"}
    straight = open_study(TOY, tmp_path / "straight", grid=grid)
    run_jobs(TOY, straight)
    for name in ("a", "b"):
        assert _rows(folder / name) == _rows(tmp_path / "straight" / name)
    results = [json.loads((f / "c" / "result.json").read_text()) for f in (folder, straight.out)]
    assert results[0]["result"]["diff"] == results[1]["result"]["diff"]
    record = json.loads((folder / "study.json").read_text())
    entry = record["jobs"]["a"]
    assert (entry["status"], entry["attempts"], entry["interrupted"]) == ("done", 1, 1)


def wait_for(inputs: Mapping[str, Path], folder: Path, path: str, timeout_s: float) -> dict:
    """A computation that waits until ``path`` exists (at most ``timeout_s``)."""
    deadline = time.time() + timeout_s
    while not Path(path).exists() and time.time() < deadline:
        time.sleep(0.05)
    return {"saw": Path(path).exists()}


def test_a_job_starts_when_its_needs_are_done_not_when_every_running_job_is(tmp_path):
    # "watch" runs beside "a" and waits for "b", which needs only "a": it sees "b" finish
    # only when "b" starts while "watch" still runs.
    folder = tmp_path / "eager"
    mark = str(folder / "b" / "summary.json")

    def jobs(ctx: Context[Any]) -> list[Any]:
        return [
            Run("a", make_config(STUDY_RUN), group="train"),
            Compute("watch", wait_for, {"path": mark, "timeout_s": 240.0}),
            Run("b", make_config(STUDY_RUN), needs=("a",), group="train"),
        ]

    study = dataclasses.replace(TOY, name="eager", jobs=jobs)
    ctx = open_study(study, folder, grid={}, workers=2)
    run_jobs(study, ctx)
    assert ctx.done == {"a", "watch", "b"}
    assert json.loads((folder / "watch" / "result.json").read_text())["result"] == {"saw": True}


def sleep_then(inputs: Mapping[str, Path], folder: Path, seconds: float, die: bool) -> dict:
    """A computation that sleeps ``seconds``, then returns or kills its process (SIGKILL)."""
    time.sleep(seconds)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    return {}


def _dying_jobs(ctx: Context[Any]) -> list[Any]:
    return [
        Compute("slow", sleep_then, {"seconds": 0.5, "die": False}),
        Compute("die", sleep_then, {"seconds": 0.0, "die": True}, needs=("slow",)),
    ]


def _invoke_and_die(folder: str) -> None:
    study = dataclasses.replace(TOY, name="dying", jobs=_dying_jobs)
    run_jobs(study, open_study(study, Path(folder), grid={}))  # in this process: one worker


def test_an_invocation_killed_by_sigkill_keeps_the_time_it_had_measured(tmp_path):
    proc = mp.get_context("spawn").Process(target=_invoke_and_die, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=240)
    assert proc.exitcode == -signal.SIGKILL
    record = json.loads((tmp_path / "study.json").read_text())
    assert record["jobs"]["slow"]["status"] == "done"
    assert record["jobs"]["die"]["status"] == "running"
    # No `finally` ran, yet the invocation's wall time covers the job that finished before.
    (inv,) = record["invocations"]
    assert inv["ran"] == 2 and inv["wall_s"] >= 0.5 and inv["cpu_s"] >= 0.0
    assert inv["wall_s"] >= record["jobs"]["slow"]["wall_s"]


# ----------------------------------------------------------------------------- statistics


def _parted_jobs(ctx: Context[Any]) -> list[Any]:
    quiet = {"seconds": 0.0, "die": False}
    return [
        Compute("p", sleep_then, quiet, part="first"),
        Compute("p2", sleep_then, quiet, needs=("p",), part="first"),  # done once p is
        Compute("q", sleep_then, quiet, needs=("p2",), part="second"),
        Compute("r", sleep_then, quiet),  # no part: the main one
    ]


def test_a_part_runs_its_own_jobs_only_after_the_parts_it_needs(tmp_path, monkeypatch, capsys):
    study = dataclasses.replace(TOY, name="parted", jobs=_parted_jobs, body=lambda c, r: [])
    folder = tmp_path / "parted"

    def ctx(part: str | None) -> Context[Any]:
        return open_study(study, folder, grid={}, part=part)

    with pytest.raises(ConfigError, match=r"no part 'third' \(its parts: first, second, main\)"):
        check_part(study, ctx("third"))
    with pytest.raises(ConfigError, match=r"q needs p2, not finished: run .* --part first` first"):
        check_part(study, ctx("second"))
    lines = dry_run(study, ctx("first"))
    assert lines[0].startswith("| job | kind | needs | part | status")
    assert lines[-1].startswith("4 jobs, 2 to run in part first")
    run_jobs(study, ctx("first"))
    assert (folder / "p2").is_dir() and not (folder / "q").exists()
    assert not (folder / "r").exists()
    check_part(study, ctx("second"))  # p and p2 are done now
    run_jobs(study, ctx("second"))
    assert (folder / "q").is_dir() and not (folder / "r").exists()
    record = json.loads((folder / "study.json").read_text())
    assert [i["command"] for i in record["invocations"]] == [
        "fedfm reproduce parted --part first",
        "fedfm reproduce parted --part second",
    ]
    assert {n: e["status"] for n, e in record["jobs"].items()} == dict.fromkeys(
        ("p", "p2", "q"), "done"
    )
    # A refusal on the command line is one line: FedSDR's parts, asked for one it lacks.
    argv = ["reproduce", "fedsdr", "--quick", "--part", "nope", "--out", str(tmp_path / "f")]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and len((out + err).strip().splitlines()) == 1
    assert "its parts: pilot, fedsd, fedsdr, personal" in out + err


def test_paired_statistics_by_hand():
    # Over seeds: d = 1, 1, 3 over the seeds both have: mean 5/3, sd √(4/3), SE sd/√3.
    est = paired({0: 1.0, 1: 2.0, 2: 4.0, 7: 9.0}, {0: 0.0, 1: 1.0, 2: 1.0})
    assert est.n == 3 and est.mean == pytest.approx(5 / 3)
    assert est.se == pytest.approx(math.sqrt(4 / 3) / math.sqrt(3))
    # Over items keyed by (domain, id): d = 0.5, −0.5, 1 (the unmatched item left out).
    a = {("x", "1"): 1.0, ("x", "2"): 0.0, ("y", "1"): 1.0, ("y", "9"): 1.0}
    b = {("x", "1"): 0.5, ("x", "2"): 0.5, ("y", "1"): 0.0}
    items = paired(a, b)
    assert items.n == 3 and items.mean == pytest.approx(1 / 3)
    sd = math.sqrt(((0.5 - 1 / 3) ** 2 + (-0.5 - 1 / 3) ** 2 + (1 - 1 / 3) ** 2) / 2)
    assert items.se == pytest.approx(sd / math.sqrt(3))
    # Independent domains: the mean of the means, SE √(0.3² + 0.4²) / 2 = 0.25.
    both = mean_of([Estimate(1.0, 0.3, 4), Estimate(3.0, 0.4, 5), stats.NONE])
    assert (both.mean, both.n) == (2.0, 9) and both.se == pytest.approx(0.25)


def test_macro_f1_bootstrap_is_paired_deterministic_and_exact_at_its_point():
    y, pa, pb = [0, 1, 1, 0], [0, 0, 1, 2], [0, 1, 1, 1]
    # By hand, F1 = 2·TP / (2·TP + FP + FN) per class: pa 1/2, 2/3, 0 (mean 7/18); pb 2/3,
    # 4/5 (mean 11/15); the difference −31/90.
    d = macro_f1_diff(y, pa, pb, seed=3)
    assert d.mean == pytest.approx(-31 / 90) and d.n == 4 and d.se > 0
    assert macro_f1(torch.tensor(pa), torch.tensor(y)) == pytest.approx(7 / 18)
    assert macro_f1_diff(y, pa, pb, seed=3) == d  # the same seed, the same resamples
    assert macro_f1_diff(y, pa, pb, seed=4).se != d.se
    same = macro_f1_diff(y, pa, pa)
    assert same.mean == 0 and same.se == 0  # a set against itself: every resample differs by 0
    # The resamples are paired: the SE is the spread of f1(a) − f1(b) on the same rows.
    boot = stats.paired_bootstrap(4, lambda idx: float(len(set(idx.tolist()))), 50, seed=1)
    assert boot.mean == 4.0 and boot.n == 4


def test_crossed_statistics_by_hand():
    # d[seed, row]: seed means 1, 2 (s² = 0.5), row means 1, 2, 1.5 (s² = 0.25):
    # SE² = 0.5 / 2 + 0.25 / 3.
    d = [[0.0, 2.0, 1.0], [2.0, 2.0, 2.0]]
    est = stats.crossed(d)
    assert est.mean == pytest.approx(1.5) and est.n == 6
    assert est.se == pytest.approx(math.sqrt(0.5 / 2 + 0.25 / 3))
    # One seed: the SE of the rows alone, as paired over rows.
    one = stats.crossed([[0.0, 1.0, 1.0, 0.0]])
    assert one.se == pytest.approx(math.sqrt(1 / 3) / 2)  # sd of 0, 1, 1, 0 over √4
    assert stats.crossed([]) == stats.NONE
    # The two-way bootstrap of a mean: close to the formula on a larger array, exact at its point.
    rng = np.random.default_rng(0)
    big = rng.normal(size=(20, 1)) + rng.normal(size=(1, 300)) + rng.normal(size=(20, 300))
    boot = stats.crossed_bootstrap(big.shape, lambda si, ri: float(big[si][:, ri].mean()), 400)
    assert boot.mean == pytest.approx(big.mean())
    assert boot.se == pytest.approx(stats.crossed(big).se, rel=0.25)
    same = stats.crossed_bootstrap((3, 4), lambda si, ri: 0.0, 20)
    assert same.se == 0 and same.n == 12


def test_macro_f1_of_each_row_is_the_scorers():
    y = np.array([0, 1, 1, 0, 2])
    pred = np.array([[0, 0, 1, 2, 2], [1, 1, 1, 1, 1], [0, 1, 1, 0, 2]])
    want = [macro_f1(torch.tensor(p), torch.tensor(y)) for p in pred]
    assert stats.macro_f1_rows(pred, y).tolist() == pytest.approx(want)


def test_a_readout_whose_premise_fails_cannot_be_tested():
    r = Readout("x", "s", "p", +1, lambda d: Estimate(1.0, 0.1, 5), testable=lambda d: d > 0)
    assert r.judge(1)[1] == stats.IN_DIRECTION
    assert r.judge(0)[1] == "cannot be tested by this grid"


def test_the_verdict_rule():
    assert verdict(Estimate(0.5, 0.2, 3), +1) == stats.IN_DIRECTION
    assert verdict(Estimate(0.5, 0.2, 3), -1) == stats.AGAINST
    assert verdict(Estimate(0.3, 0.2, 3), +1) == stats.UNRESOLVED  # 0.3 ≤ 2 × 0.2
    assert verdict(Estimate(3.0, 0.5, 4), +1, null=1.0) == stats.IN_DIRECTION  # a ratio
    assert verdict(Estimate(1.5, 0.5, 4), +1, null=1.0) == stats.UNRESOLVED
    assert verdict(Estimate(2.0, math.nan, 1), +1).startswith("no SE (one value, in the")
    assert verdict(stats.NONE, +1) == "not measured"


def test_merge_recurses_into_mappings_and_copies():
    base = {"task": {"lora": {"r": 8, "alpha": 16}, "kind": "x"}, "rounds": 3}
    out = merge(base, {"task": {"lora": {"r": 4}}, "rounds": 5, "new": [1]})
    assert out == {"task": {"lora": {"r": 4, "alpha": 16}, "kind": "x"}, "rounds": 5, "new": [1]}
    assert base["task"]["lora"]["r"] == 8  # the base is left alone
    saved = yaml.safe_dump(out)
    assert yaml.safe_load(saved) == out
