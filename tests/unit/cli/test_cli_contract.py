"""The ``fedfm`` command's contract, through its real entry point (:func:`fedfm.cli.main`).

Exit codes: 0 on success, 1 for a run that fails (too few clients answered), 2 for bad input
and for usage errors; a fedfm error is one line on stderr, checked word for word here.
``--resume`` continues the saved experiment: the run folder's config, with only the
overrides given on the command line applied. ``fedfm report`` and ``fedfm reproduce`` run
through the same entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import helpers.toy  # noqa: F401  (registers the toy task)
from helpers import TESTS
from helpers.cli import run_cli
from helpers.config import toy_yaml


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- exit codes


def test_success_exits_0_and_prints_the_final_metric(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["run", str(toy_yaml(tmp_path)), "-q"], monkeypatch, capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "runs" / "c" / "summary.json").read_text())
    rmse = summary["final"]["rmse"]
    assert f"c: rmse={rmse:.4f} after 2 rounds" in " ".join(out.split())


def test_a_failing_run_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    # A learning rate of 1e30 makes every client's loss NaN: each reply is refused, so no
    # client answers and the round fails.
    path = toy_yaml(tmp_path, train={"steps": 3, "batch_size": 8, "lr": 1e30})
    code, _, err = run_cli(["run", str(path), "-q"], monkeypatch, capsys)
    assert code == 1
    lines = [x for x in err.splitlines() if not x.startswith("WARNING")]
    assert lines == ["error: round 1: only 0 of 4 clients answered, min_clients=2"]
    fails = (tmp_path / "runs" / "c" / "failures.jsonl").read_text().splitlines()
    assert len(fails) == 4  # the failures that stopped the run are kept


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["train.lr=-1"], "error: config error: train.lr: input should be greater than 0 (got -1)"),
        (["rounds=two"], "error: config error: rounds: input should be a valid integer"),
        (
            ["algorithm=nope"],
            "error: config error: algorithm: unknown algorithm 'nope' (choose from",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_field(
    tmp_path, monkeypatch, capsys, argv, line
):
    code, _, err = run_cli(["run", str(toy_yaml(tmp_path)), *argv], monkeypatch, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert not (tmp_path / "runs" / "c").exists()  # nothing written


@pytest.mark.parametrize(
    ("argv", "last"),
    [
        (["run"], "Error: Missing argument 'CONFIG'."),
        (["run", "x.yaml", "--bogus"], "Error: No such option '--bogus'."),
        (["nope"], "Error: No such command 'nope'."),
        (["reproduce", "fedekd", "--quick=3"], "Error: Option '--quick' does not take a value."),
    ],
)
def test_usage_errors_exit_2(monkeypatch, capsys, argv, last):
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == last


def test_an_unknown_study_exits_2_naming_the_choices(monkeypatch, capsys):
    code, _, err = run_cli(["reproduce", "nope"], monkeypatch, capsys)
    assert code == 2 and err.startswith(
        "error: config error: study: unknown reproduction 'nope'"
    ), err
    assert "fedekd" in err and len(err.strip().splitlines()) == 1


def test_the_process_exit_status_is_the_contract(tmp_path):
    """One real process: the status the shell sees, not only ``SystemExit.code``."""
    path = toy_yaml(tmp_path, train={"steps": 3, "batch_size": 8, "lr": 1e30})
    script = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import helpers.toy;"
        f" from fedfm.cli import main; sys.argv = ['fedfm', 'run', {str(path)!r}, '-q']; main()"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: round 1: only 0 of 4 clients answered, min_clients=2"
    )
    assert "Traceback" not in out.stderr


def test_python_dash_m_fedfm_is_the_same_command_line(tmp_path):
    """``python -m fedfm`` runs the same app: a bad run name is exit 2 with its one line."""
    out = subprocess.run(
        [sys.executable, "-m", "fedfm", "run", "tabular-fedavg", "name=../x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: config error: name: ")
    assert not any(tmp_path.iterdir())  # refused before anything was written


# ----------------------------------------------------------------------------- --resume


def test_resume_reloads_the_saved_config_and_applies_only_the_overrides_given(
    tmp_path, monkeypatch, capsys
):
    path = toy_yaml(tmp_path)
    assert run_cli(["run", str(path), "-q"], monkeypatch, capsys)[0] == 0
    folder = tmp_path / "runs" / "c"
    # The file on the command line changes afterwards; a resumed run must not follow it.
    toy_yaml(tmp_path, seed=9, train={"steps": 7, "batch_size": 4, "lr": 0.5})
    code, _, err = run_cli(["run", str(path), "--resume", "rounds=4", "-q"], monkeypatch, capsys)
    assert code == 0, err
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert saved["rounds"] == 4  # the override given
    assert saved["seed"] == 1 and saved["train"]["lr"] == 0.05  # the rest: as saved
    assert saved["train"]["steps"] == 3 and saved["train"]["batch_size"] == 8
    assert [r["round"] for r in _rows(folder)] == [0, 1, 2, 3, 4]
    # The resumed rounds equal those of a run made in one go with rounds=4.
    once = toy_yaml(tmp_path, name="once", rounds=4)
    assert run_cli(["run", str(once), "-q"], monkeypatch, capsys)[0] == 0

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "time_s"} for r in rows]

    assert strip(_rows(folder)) == strip(_rows(tmp_path / "runs" / "once"))


def test_resume_refuses_a_bad_override_of_the_saved_config(tmp_path, monkeypatch, capsys):
    path = toy_yaml(tmp_path, rounds=1)
    assert run_cli(["run", str(path), "-q"], monkeypatch, capsys)[0] == 0
    code, _, err = run_cli(["run", str(path), "--resume", "train.lr=0"], monkeypatch, capsys)
    assert (
        code == 2
        and err.strip() == "error: config error: train.lr: input should be greater than 0 (got 0)"
    )


# ----------------------------------------------------------------------------- report, reproduce


def test_report_through_the_entry_point(tmp_path, monkeypatch, capsys):
    for name, algorithm in (("a", "fedavg"), ("b", "fedprox")):
        path = toy_yaml(tmp_path, name=name, algorithm=algorithm, rounds=1)
        assert run_cli(["run", str(path), "-q"], monkeypatch, capsys)[0] == 0
    runs = tmp_path / "runs"
    code, out, err = run_cli(
        ["report", str(runs / "a"), str(runs / "b"), "--out", str(tmp_path / "cmp")],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    lines = out.strip().splitlines()
    cmp = tmp_path / "cmp"
    assert lines[-1] == f"wrote {cmp / 'compare.md'} and {cmp / 'compare.png'}"
    lines = lines[:-1]
    assert lines[0].startswith("| run | algorithm | rounds | rmse |") and len(lines) == 4
    for line, name in zip(lines[2:], "ab", strict=True):
        s = json.loads((runs / name / "summary.json").read_text())
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [name, s["algorithm"], "1", f"{s['final']['rmse']:.4f}"]
        assert cells[-2:] == [f"{s['bytes_up'] / 2**20:.2f}", f"{s['bytes_down'] / 2**20:.2f}"]
    assert (cmp / "compare.md").read_text().strip() == "\n".join(lines)
    code, _, err = run_cli(["report", str(tmp_path / "nothing")], monkeypatch, capsys)
    assert code == 2 and "has no summary.json" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_reproduce_fedekd_skew_quick_through_the_entry_point(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(
        ["reproduce", "fedekd_skew", "--quick", "--out", str(tmp_path)], monkeypatch, capsys
    )
    assert code == 0, err
    report = tmp_path / "fedekd_skew-quick" / "fedekd_skew-quick.md"
    # Rich wraps the line at the terminal width: compare without whitespace.
    assert "".join(f"report written: {report}".split()) == "".join(out.split())
    text = report.read_text()
    assert "fedfm reproduce fedekd_skew --quick" in text and "## Failed runs" not in text


def test_reproduce_pilot_lists_only_the_studys_premise_pilot(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(
        ["reproduce", "fedhds", "--pilot", "--dry-run", "--out", str(tmp_path)], monkeypatch, capsys
    )
    assert code == 0, err
    jobs = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert jobs[1:] == ["fedit", "probe"]  # the header, FedIT's first seed, FedHDS's round
    assert not (tmp_path / "fedhds").exists()  # a dry run writes nothing
