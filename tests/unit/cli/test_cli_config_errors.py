"""Malformed configs print one line naming the field, exit with code 2, and write nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedfm import cli

BASE = ["run", "tabular-fedavg", "rounds=1", "plots=false"]

CASES = [
    (["foo=1"], "foo: unknown key"),
    (["rounds=abc"], "rounds: input should be a valid integer"),
    (["rounds=-1"], "rounds: input should be greater than or equal to 0"),
    (["seed=1.5"], "seed:"),
    (["clients.fraction=0"], "clients.fraction: input should be greater than 0"),
    (["clients.fraction=1.5"], "clients.fraction: input should be less than or equal to 1"),
    (["clients.min_clients=0"], "clients.min_clients"),
    (["clients.roles={strong: 2}"], "clients.roles"),
    (["train.lr=0"], "train.lr: input should be greater than 0"),
    (["train.optimizer=rmsprop"], "train.optimizer"),
    (["train.clip_norm=-1"], "train.clip_norm"),
    (["train.batch_size=big"], "train.batch_size"),
    (["runtime=mars"], "runtime"),
    (["eval_every=0"], "eval_every"),
    (["name=a/b"], "name:"),
    (["algorithm=nope"], "algorithm: unknown algorithm 'nope' (choose from"),
    (["algo.foo=1"], "algo.foo: unknown key"),
    (["algo.server_opt.name=sgd"], "algo.server_opt.name"),
    (["algo.server_opt.beta1=1.5"], "algo.server_opt.beta1"),
    (["algorithm=fedrd"], "algo.teacher: no default foundation model for a task without images"),
    (["algorithm=fedrd", "algo.teacher=minilm"], "algo.teacher: 'minilm' needs texts(data)"),
    (["task.kind=nope"], "task.kind: unknown task 'nope'"),
    (["task.dataset=nope"], "task.dataset: unknown dataset 'nope'"),
    (["task.test_fraction=1.5"], "task.test_fraction"),
    (["task.colour=red"], "task.colour: unknown key"),
    (["task.dataset=fashion_mnist"], "task.dataset: 'fashion_mnist' is a image-classification set"),
    (["partition.scheme=weird"], "partition.scheme"),
    (["partition.alpha=-1"], "partition.alpha"),
    (["partition.num_clients=0"], "partition.num_clients"),
    (["partition.by=colour"], "partition"),
    (["train.lr.x=1"], "train.lr: is not a section"),
    (["rounds"], "override: 'rounds' is not of the form key=value"),
    (["name=."], "name: must be one plain folder name"),
    (["name=.."], "name: must be one plain folder name"),
    (["train.lr=.inf"], "train.lr: must be a finite number (got inf)"),
    (["train.lr=inf"], "train.lr: input should be a finite number"),
    (["algo.server_opt.lr=.nan"], "algo.server_opt.lr: must be a finite number (got nan)"),
    (["task.model_args={hidden: [64, .inf]}"], "task.model_args.hidden.1: must be a finite"),
    (["partition.alpha=-.inf"], "partition.alpha: must be a finite number"),
    (["clients.min_clients=11"], "clients.min_clients: 11 is more than the 10 clients"),
]


def _run(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fedfm", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "expected"), CASES)
def test_bad_override_is_one_line_exit_2(overrides, expected, tmp_path, monkeypatch, capsys):
    code, err = _run([*BASE, f"out_dir={tmp_path}", *overrides], monkeypatch, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected.lower() in lines[0].lower(), lines[0]
    assert not (tmp_path / "tabular-fedavg" / "metrics.jsonl").exists()


def test_missing_preset_and_file(tmp_path, monkeypatch, capsys):
    code, err = _run(["run", "no-such-preset"], monkeypatch, capsys)
    assert code == 2 and "unknown preset 'no-such-preset'" in err
    code, err = _run(["run", str(tmp_path / "missing.yaml")], monkeypatch, capsys)
    assert code == 2 and "file not found" in err


def test_bad_yaml_files(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    code, err = _run(["run", str(bad)], monkeypatch, capsys)
    assert code == 2 and "is not valid YAML" in err and len(err.strip().splitlines()) == 1
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    code, err = _run(["run", str(lst)], monkeypatch, capsys)
    assert code == 2 and "must hold a mapping" in err


def test_existing_run_folder_is_not_overwritten(tmp_path, monkeypatch, capsys):
    (tmp_path / "tabular-fedavg").mkdir()
    (tmp_path / "tabular-fedavg" / "keep.txt").write_text("precious")
    code, err = _run([*BASE, f"out_dir={tmp_path}"], monkeypatch, capsys)
    assert code == 2 and "exists: pass --resume" in err
    assert (tmp_path / "tabular-fedavg" / "keep.txt").read_text() == "precious"


def test_real_cli_process_exit_code():
    out = subprocess.run(
        [sys.executable, "-m", "fedfm.cli", "run", "tabular-fedavg", "train.lr=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "train.lr" in out.stderr and "Traceback" not in out.stderr
