"""Switching algorithms from the command line, ``fedfm list``, and a table that fits 80 columns."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
from rich.console import Console

from fedfm import cli
from fedfm.config import load_config
from fedfm.core.optim import SERVER_OPTIMIZERS
from fedfm.core.robust import AGGREGATORS
from fedfm.progress import RoundDisplay

BASE = ["run", "tabular-fedavg", "rounds=1", "plots=false", "-q"]


def _cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["fedfm", *argv])
    try:
        cli.main()
    except SystemExit as e:
        out = capsys.readouterr()
        return int(e.code or 0), out.out, out.err
    out = capsys.readouterr()
    return 0, out.out, out.err


# ----------------------------------------------------------------------------- 9


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=scaffold"],
        ["algorithm=fedprox"],
        ["algorithm=fedprox", "algo.mu=0.1", "algo.server_opt.name=fedyogi"],
        ["algorithm=scaffold", "algo.aggregator.name=median"],
        *[[f"algo.server_opt.name={name}"] for name in SERVER_OPTIMIZERS],
        *[[f"algo.aggregator.name={name}"] for name in AGGREGATORS],
    ],
    ids=lambda o: " ".join(o),
)
def test_the_tabular_preset_runs_with_any_algorithm_optimizer_or_aggregator(
    overrides, tmp_path, monkeypatch, capsys
):
    code, _, err = _cli([*BASE, f"out_dir={tmp_path}", *overrides], monkeypatch, capsys)
    assert code == 0, err
    saved = load_config(str(tmp_path / "tabular-fedavg" / "config.yaml"))
    algorithm = next((o.split("=")[1] for o in overrides if o.startswith("algorithm=")), "fedavg")
    assert saved.algorithm == algorithm
    rows = (tmp_path / "tabular-fedavg" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["clients"] == 10


def test_switching_algorithm_drops_foreign_preset_keys_with_one_notice(
    tmp_path, monkeypatch, capsys, caplog
):
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        code, _, err = _cli(
            [*BASE, f"out_dir={tmp_path}", "algorithm=scaffold"], monkeypatch, capsys
        )
    notes = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert code == 0 and len(notes) == 1, err
    assert "algo.server_opt" in notes[0] and "scaffold takes " in notes[0]
    assert "lr_global" in notes[0].split("scaffold takes ")[1]


def test_keys_set_on_the_command_line_and_preset_typos_are_still_errors(
    tmp_path, monkeypatch, capsys
):
    argv = [*BASE, f"out_dir={tmp_path}", "algorithm=scaffold", "algo.server_opt.name=fedadam"]
    code, _, err = _cli(argv, monkeypatch, capsys)
    assert code == 2 and "algo.server_opt: unknown key" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("algorithm: fedavg\nalgo: {servr_opt: {name: fedadam}}\n")
    code, _, err = _cli(["run", str(typo), "rounds=1"], monkeypatch, capsys)
    assert code == 2 and "algo.servr_opt: unknown key" in err
    code, _, err = _cli(["run", str(typo), "algorithm=fedavg"], monkeypatch, capsys)
    assert code == 2 and "algo.servr_opt: unknown key" in err  # not a switch: nothing dropped


# ----------------------------------------------------------------------------- 10


def test_list_shows_server_optimizers_and_aggregators_with_their_keys(monkeypatch, capsys):
    code, out, err = _cli(["list"], monkeypatch, capsys)
    assert code == 0, err
    assert "algo.server_opt.name=NAME" in out and "algo.aggregator.name=NAME" in out
    for name in [*SERVER_OPTIMIZERS, *AGGREGATORS]:
        assert f" {name} " in out, name
    for option in ("clip_norm", "trim_fraction", "byzantine", "max_share"):
        assert f"algo.aggregator.{option}=" in out
    used = [line for line in out.splitlines() if line.startswith("used by:")]
    assert len(used) == 2 and "scaffold" in used[1] and "local" not in " ".join(used)


# ----------------------------------------------------------------------------- 11


ROWS = [
    {"round": 0, "acc": 0.4321987, "macro_f1": 0.3, "loss": 0.73551234, "failed": 0,
     "bytes_up": 735, "bytes_down": 250960, "local/acc": 0.431, "local/acc/worst": 0.1,
     "time_s": 0.2},
    *[
        {"round": r, "train_loss": 0.5189123, "clients": 10, "acc": 0.763212, "macro_f1": 0.6,
         "loss": 0.458, "failed": 1, "bytes_up": 1474560123, "bytes_down": 2949120246,
         "local/acc": 0.7, "local/acc/worst": 0.2, "local/loss": 0.5, "time_s": 12.5}
        for r in range(1, 101)
    ],
]  # fmt: skip


def _display(primary: str = "acc") -> tuple[RoundDisplay, io.StringIO]:
    cfg = load_config({"name": "a-rather-long-run-name", "rounds": 100})
    buf = io.StringIO()
    console = Console(file=buf, width=80, color_system=None)
    return RoundDisplay(cfg, primary=primary, console=console), buf


def test_final_table_fits_80_columns_without_truncation():
    display, buf = _display()
    display.final_table(ROWS)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in buf.getvalue()
    header = next(line for line in lines if "round" in line and "acc" in line)
    for col in ("acc", "loss", "train_loss", "clients", "failed", "MiB up", "MiB down"):
        assert col in header
    assert "1406" in lines[-1] and "2813" in lines[-1]  # bytes shown as MiB, in full


def test_round_lines_are_one_line_each_at_80_columns():
    """A round is one line, never broken at the console's 80 columns (the terminal may wrap
    it; a log file keeps it whole)."""
    display, buf = _display()
    with display:
        display.update(ROWS[1])
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 1 and "acc=0.7632" in lines[0] and "MiB 1406/2813  12.50s" in lines[0]
