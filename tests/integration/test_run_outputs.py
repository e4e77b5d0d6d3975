"""What a run leaves and how runs are compared: failures.jsonl, ``fedfm report``, and a
partition that would silently make a one-client federation."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.figure
import pytest
from typer.testing import CliRunner

from fedfm.cli import app
from fedfm.config import load_config
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.report import compare
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)


def _toy(out: Path, name: str, rounds: int = 2) -> dict:
    cfg = {
        "name": name,
        "algorithm": "fedavg",
        "rounds": rounds,
        "seed": 3,
        "task": {"kind": "toy", "num_clients": 3},
        "out_dir": str(out),
        "plots": False,
        "train": {"steps": 2, "batch_size": 8, "lr": 0.05},
    }
    return run(load_config(cfg), progress=False)


def test_failures_jsonl_exists_and_is_empty_when_nothing_failed(tmp_path):
    summary = _toy(tmp_path, "ok")
    assert summary["failed_clients"] == 0
    path = tmp_path / "ok" / "failures.jsonl"
    assert path.exists() and path.read_text() == ""
    # Resume and --overwrite keep it (and keep it empty).
    cfg = {"name": "ok", "algorithm": "fedavg", "rounds": 3, "seed": 3, "out_dir": str(tmp_path),
           "task": {"kind": "toy", "num_clients": 3}, "plots": False,
           "train": {"steps": 2, "batch_size": 8, "lr": 0.05}}  # fmt: skip
    run(load_config(cfg), resume=True, progress=False)
    assert path.read_text() == ""
    run(load_config(cfg), overwrite=True, progress=False)
    assert path.read_text() == "" and not list(tmp_path.glob(".ok.replaced-*"))


def _fake_run(root: Path, name: str, metric: str | None, failed: int, rounds: int = 2) -> Path:
    """A run folder as the engine writes it (summary.json and metrics.jsonl only)."""
    d = root / name
    d.mkdir()
    rows = [{"round": r, **({metric: 0.1 * r} if metric else {"loss": 1.0})} for r in range(3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = rows[-1]
    summary = {"name": name, "algorithm": "fedavg", "rounds": rounds, "primary": "acc"}
    summary.update(final=final, bytes_up=2**20, bytes_down=2**21, failed_clients=failed)
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_report_counts_failed_clients_and_plots_only_runs_with_the_metric(tmp_path, monkeypatch):
    runs = [
        _fake_run(tmp_path, "a", "acc", 0),
        _fake_run(tmp_path, "lost", "acc", 4),
        _fake_run(tmp_path, "other", None, 0),
    ]
    figs: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda f, *a, **k: figs.append(f) or save(f, *a, **k)
    )
    table = compare(runs, tmp_path / "cmp").splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    col = head.index("failed clients")
    assert [row.strip("|").split("|")[col].strip() for row in table[2:]] == ["0", "4", "0"]
    ax = figs[-1].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "lost"]
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_report_without_out_writes_next_to_the_runs_and_says_where(tmp_path):
    runs = [_fake_run(tmp_path, "a", "acc", 0), _fake_run(tmp_path, "b", "acc", 1)]
    res = CliRunner().invoke(app, ["report", *map(str, runs)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "compare"
    assert (out / "compare.md").exists() and (out / "compare.png").stat().st_size > 1000
    assert f"wrote {out / 'compare.md'} and {out / 'compare.png'}" in res.output


def test_a_source_without_domains_is_refused_for_a_natural_partition(tmp_path):
    from helpers.bases import INSTRUCTION
    from helpers.config import make_config

    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(20)]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(rows))
    task = {"dataset": "hf", "source_options": {"path": str(path)}, "test_fraction": 0.2}
    with pytest.raises(ConfigError, match=r"partition\.by: every training row has the same"):
        build(load_config(make_config(INSTRUCTION, tmp_path, task=task)))  # natural: by domain
    # Asked for explicitly, one partition scheme or another is fine.
    iid = make_config(
        INSTRUCTION, tmp_path, task=task, partition={"scheme": "iid", "num_clients": 2}
    )
    assert len(build(load_config(iid)).task.client_ids()) == 2
