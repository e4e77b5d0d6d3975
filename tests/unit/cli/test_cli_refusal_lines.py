"""A refused ``fedfm run`` prints its one error line and nothing else (stdout and stderr).

The memory-plan and device lines are printed only once every check has passed: the config,
the built task and algorithm (``clients.min_clients``, a FedeKD proxy of width 0) and the run
folder (one that exists, damaged logs on ``--resume``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.config import toy_yaml


def _lines(out: str, err: str) -> list[str]:
    return [x for x in (out + err).splitlines() if x.strip()]


def _finished_run(tmp_path: Path, monkeypatch, capsys) -> Path:
    code, _, err = run_cli(["run", str(toy_yaml(tmp_path)), "-q", "rounds=1"], monkeypatch, capsys)
    assert code == 0, err
    return tmp_path / "runs" / "c"


def test_a_run_that_passes_prints_the_plan_and_device_lines_first(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["run", str(toy_yaml(tmp_path)), "rounds=1"], monkeypatch, capsys)
    assert code == 0, err
    lines = _lines(out, err)
    assert lines[0].startswith("plan: ") and lines[1].startswith("device auto: cpu")


def test_too_few_clients_for_min_clients_is_one_line(tmp_path, monkeypatch, capsys):
    argv = ["run", str(toy_yaml(tmp_path)), "clients.min_clients=50"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2
    assert _lines(out, err) == [
        "error: config error: clients.min_clients: 50 is more than the 4 clients"
    ]
    assert not (tmp_path / "runs" / "c").exists()


def test_a_zero_width_fedekd_proxy_is_one_line(tmp_path, monkeypatch, capsys):
    argv = ["run", "fedekd-digits", f"out_dir={tmp_path}", "algo.proxy_arch.width=0"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2
    assert _lines(out, err) == [
        "error: config error: algo.proxy_arch.width: must be a positive integer, got 0"
    ]
    assert not list(tmp_path.iterdir())


def test_an_existing_run_folder_is_one_line(tmp_path, monkeypatch, capsys):
    folder = _finished_run(tmp_path, monkeypatch, capsys)
    code, out, err = run_cli(["run", str(toy_yaml(tmp_path))], monkeypatch, capsys)
    assert code == 2
    assert _lines(out, err) == [
        f"error: config error: name: run folder {folder} exists:"
        " pass --resume to continue it or --overwrite"
    ]


@pytest.mark.parametrize("log", ["metrics.jsonl", "audit.jsonl"])
def test_a_damaged_log_on_resume_is_one_line(tmp_path, monkeypatch, capsys, log):
    folder = _finished_run(tmp_path, monkeypatch, capsys)
    path = folder / log
    rows = path.read_text().splitlines()
    path.write_text("\n".join(["{broken", *rows[1:]]) + "\n")
    before = path.read_bytes()
    argv = ["run", str(toy_yaml(tmp_path)), "--resume", "rounds=2"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2
    assert _lines(out, err) == [
        f"error: config error: run folder: {path}: line 1 is not valid JSON"
    ]
    assert path.read_bytes() == before  # nothing changed
