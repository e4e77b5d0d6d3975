"""A run folder is the user's work: bad configs, names, overwrites and resumes never lose it."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file, save_file

from fedfm import cli
from fedfm.algorithms.base import ALGORITHMS
from fedfm.algorithms.fedavg import FedAvg
from fedfm.config import load_config
from fedfm.errors import ConfigError
from fedfm.models.lora import named_adapter_keys
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)
from helpers.bases import INSTRUCTION
from helpers.config import make_config, toy_config
from helpers.grid import flower_run, same_run

# The in-memory Flower grid runs in this process: it needs a task identity (conftest.py).
pytestmark = pytest.mark.usefixtures("task_identity")

BASE = ["run", "tabular-fedavg", "rounds=1", "plots=false", "-q"]


def _cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["fedfm", *argv])
    try:
        cli.main()
    except SystemExit as e:
        return int(e.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _toy(tmp_path: Path, name: str = "r", **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "algorithm": "fedavg",
        "rounds": kw.pop("rounds", 3),
        "task": {"kind": "toy"},
        "out_dir": str(tmp_path),
        "plots": False,
        "train": {"steps": 3, "batch_size": 8, "lr": 0.05},
        **kw,
    }


def _run(tmp_path: Path, name: str = "r", resume: bool = False, overwrite: bool = False, **kw):
    cfg = load_config(_toy(tmp_path, name, **kw))
    return run(cfg, resume=resume, overwrite=overwrite, progress=False)


@pytest.fixture
def old_run(tmp_path, monkeypatch, capsys) -> Path:
    """A finished tabular-fedavg run plus a file of the user's own."""
    code, err = _cli([*BASE, f"out_dir={tmp_path}"], monkeypatch, capsys)
    assert code == 0, err
    root = tmp_path / "tabular-fedavg"
    (root / "notes.md").write_text("my notes")
    return root


# ----------------------------------------------------------------------------- 1: build first


BUILD_ERRORS = [
    (["partition.num_clients=1000"], "partition.num_clients: 1000 clients for only"),
    (
        ["partition.scheme=pathological", "partition.classes_per_client=5"],
        "partition.classes_per_client",
    ),
    (["task.model_args={hidden: [-8]}"], "task.model_args.hidden: must be a positive integer"),
    (["task.model_args.colour=red"], "task.model_args: bad arguments for model 'mlp'"),
    (["task.model=nope"], "task.model: unknown model 'nope'"),
    (["task.source_options.colour=red"], "task.source_options.colour"),
    (["task.dataset=hf", "task.source_options.path=/no/such.csv"], "task.source_options.path"),
    (["clients.min_clients=11"], "clients.min_clients: 11 is more than the 10 clients"),
]


@pytest.mark.parametrize(("overrides", "expected"), BUILD_ERRORS)
def test_build_errors_never_touch_an_existing_folder(
    old_run, overrides, expected, monkeypatch, capsys
):
    before = _tree(old_run)
    code, err = _cli(
        [*BASE, f"out_dir={old_run.parent}", "--overwrite", *overrides], monkeypatch, capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert expected in err
    assert _tree(old_run) == before
    assert sorted(p.name for p in old_run.parent.iterdir()) == ["tabular-fedavg"]


def test_build_errors_create_no_folder(tmp_path, monkeypatch, capsys):
    code, err = _cli(
        [*BASE, f"out_dir={tmp_path}", "partition.num_clients=1000"], monkeypatch, capsys
    )
    assert code == 2 and "partition.num_clients" in err
    assert not (tmp_path / "tabular-fedavg").exists()


def test_fedekd_architecture_errors_name_the_algo_field(tmp_path, monkeypatch, capsys):
    argv = [*BASE, f"out_dir={tmp_path}", "algorithm=fedekd"]
    code, err = _cli([*argv, "algo.proxy_arch={hidden: [0]}"], monkeypatch, capsys)
    assert code == 2 and "algo.proxy_arch.hidden: must be a positive integer" in err
    code, err = _cli(
        [*argv, "algo.private_archs=[{hidden: [4]}, {hidden: [0]}]"], monkeypatch, capsys
    )
    assert code == 2 and "algo.private_archs.1.hidden" in err


class FailsInRoundZero(FedAvg):
    """Builds fine, then fails while the run starts (e.g. an asset missing at round 0)."""

    def setup(self, fed):
        raise RuntimeError("disk on fire")


ALGORITHMS.register("test-fails-at-start")(FailsInRoundZero)


def test_overwrite_restores_the_old_run_when_the_new_one_fails_to_start(tmp_path):
    _run(tmp_path, rounds=2)
    root = tmp_path / "r"
    (root / "notes.md").write_text("my notes")
    before = _tree(root)
    with pytest.raises(RuntimeError, match="disk on fire"):
        _run(tmp_path, overwrite=True, algorithm="test-fails-at-start")
    assert _tree(root) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # nothing left aside


def test_a_fresh_run_that_fails_to_start_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError, match="disk on fire"):
        _run(tmp_path, algorithm="test-fails-at-start")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_fedfm_files_and_keeps_the_users(tmp_path):
    _run(tmp_path, rounds=3)
    root = tmp_path / "r"
    (root / "notes.md").write_text("my notes")
    (root / "extra").mkdir()
    (root / "extra" / "plot.svg").write_text("<svg/>")
    _run(tmp_path, rounds=1, overwrite=True)
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]  # the new run only
    assert (root / "notes.md").read_text() == "my notes"
    assert (root / "extra" / "plot.svg").read_text() == "<svg/>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# ----------------------------------------------------------------------------- 2: names


@pytest.mark.parametrize("name", [".", "..", "", "a/b", "/tmp/x", "../up", ".hidden", "a b"])
def test_run_name_is_one_plain_path_component(name, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "other").mkdir(parents=True)
    (tmp_path / "runs" / "other" / "keep.txt").write_text("x")
    before = _tree(tmp_path)
    for flag in ("--overwrite", "--resume"):
        argv = [*BASE, f"out_dir={tmp_path / 'runs'}", f"name={name}", flag]
        code, err = _cli(argv, monkeypatch, capsys)
        assert code == 2 and err.startswith("error: config error: name:"), err
        assert len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before


# ----------------------------------------------------------------------------- 3, 4: resume


def _metrics(root: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("time_s")
    return rows


def _straight_and_cut(tmp_path: Path) -> tuple[Path, Path]:
    """An uninterrupted 4-round run, and the same run stopped after 3 rounds."""
    _run(tmp_path, "straight", rounds=4)
    _run(tmp_path, "cut", rounds=3)
    return tmp_path / "straight", tmp_path / "cut"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    # LATEST lost or unreadable: the newest complete checkpoint (round 3) is used as is.
    "no-LATEST": (lambda ck: (ck / "LATEST").unlink(), False),
    "bad-LATEST": (lambda ck: (ck / "LATEST").write_text("garbage"), False),
    # The newest checkpoint is damaged: round 2 is used, and the warning says so.
    "server-truncated": (lambda ck: _truncate(ck / "round_0003" / "server.safetensors"), True),
    "clients-truncated": (lambda ck: _truncate(ck / "round_0003" / "clients.safetensors"), True),
    "meta-truncated": (lambda ck: _truncate(ck / "round_0003" / "meta.json"), True),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_falls_back_to_the_newest_checkpoint_that_loads(tmp_path, case, caplog):
    damage, warned = DAMAGE[case]
    straight, cut = _straight_and_cut(tmp_path)
    (cut / "notes.md").write_text("mine")
    damage(cut / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        _run(tmp_path, "cut", rounds=4, resume=True)
    assert _metrics(cut) == _metrics(straight)  # as if never interrupted
    assert (cut / "notes.md").read_text() == "mine"
    assert ("round_0003" in caplog.text) == warned


def test_resume_says_which_checkpoint_it_used(tmp_path, caplog):
    _, cut = _straight_and_cut(tmp_path)
    _truncate(cut / "checkpoints" / "round_0003" / "server.safetensors")
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        _run(tmp_path, "cut", rounds=4, resume=True)
    lines = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert len(lines) == 1 and "round_0003" in lines[0] and lines[0].endswith("round_0002")


def test_resume_without_a_loadable_checkpoint_stops_and_changes_nothing(
    tmp_path, monkeypatch, capsys
):
    _, cut = _straight_and_cut(tmp_path)
    for ck in (cut / "checkpoints").glob("round_*"):
        _truncate(ck / "meta.json")
    (cut / "notes.md").write_text("mine")
    before = _tree(cut)
    with pytest.raises(Exception, match="no checkpoint loads"):
        _run(tmp_path, "cut", rounds=4, resume=True)
    assert _tree(cut) == before


def test_resume_of_a_folder_without_checkpoints_keeps_every_file(tmp_path, monkeypatch, capsys):
    root = tmp_path / "tabular-fedavg"
    root.mkdir()
    (root / "data.csv").write_text("precious")
    code, err = _cli([*BASE, f"out_dir={tmp_path}", "--resume"], monkeypatch, capsys)
    assert code == 2 and "no checkpoint loads" in err and len(err.strip().splitlines()) == 1
    assert (root / "data.csv").read_text() == "precious"
    assert [p.name for p in root.iterdir()] == ["data.csv"]


@pytest.mark.parametrize(("algorithm", "file"), [("fedavg", "server"), ("local", "clients")])
def test_a_checkpoint_of_the_earlier_adapter_keys_stops_a_resume_with_one_line(
    tmp_path, monkeypatch, capsys, algorithm, file
):
    cfg = make_config(INSTRUCTION, tmp_path, name="fedit", algorithm=algorithm, rounds=1)
    path = tmp_path / "fedit.yaml"
    path.write_text(yaml.safe_dump({**cfg, "eval_before": False}))
    assert _cli(["run", str(path), "-q"], monkeypatch, capsys)[0] == 0
    root = tmp_path / "fedit"
    ck = root / "checkpoints" / "round_0001" / f"{file}.safetensors"
    # What fedfm wrote before: the parameter names, which name the adapter ("default").
    arrays = load_file(str(ck))
    assert any(".lora_A." in k for k in arrays) and not named_adapter_keys(arrays)
    earlier = {re.sub(r"\.lora_(A|B)\.", r".lora_\1.default.", k): v for k, v in arrays.items()}
    save_file(earlier, str(ck))
    before = _tree(root)
    code, err = _cli(["run", str(path), "rounds=2", "--resume", "-q"], monkeypatch, capsys)
    said = [line for line in err.splitlines() if "error" in line]  # progress bars aside
    assert code == 2 and len(said) == 1, err
    assert f"round_0001/{file}.safetensors: LoRA tensors keyed with their adapter name" in said[0]
    assert "--overwrite" in said[0]
    assert _tree(root) == before


@pytest.mark.parametrize(
    ("log", "content", "reason"),
    [
        ("metrics.jsonl", b'{"round": 0}\n{"acc": 0.5}\n{"round": 2}\n', "line 2 has no integer"),
        ("metrics.jsonl", b'{"round": 0}\n\xff\xfe garbage\n', "not UTF-8"),
        ("failures.jsonl", b'{"client": "1"}\n{"round": 1}\n', "line 1 has no integer"),
        ("audit.jsonl", b'{"round": 0}\nnot json\n{"round": 1}\n', "line 2 is not valid JSON"),
    ],
)
def test_damaged_logs_stop_a_resume_with_one_line(
    tmp_path, monkeypatch, capsys, log, content, reason
):
    code, err = _cli([*BASE, f"out_dir={tmp_path}", "rounds=2"], monkeypatch, capsys)
    root = tmp_path / "tabular-fedavg"
    (root / log).write_bytes(content)
    before = _tree(root)
    code, err = _cli([*BASE, f"out_dir={tmp_path}", "rounds=3", "--resume"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert log in err and reason in err
    assert _tree(root) == before


def test_a_torn_last_log_line_is_still_resumed(tmp_path):
    straight, cut = _straight_and_cut(tmp_path)
    with (cut / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "rms')  # a write killed halfway
    _run(tmp_path, "cut", rounds=4, resume=True)
    assert _metrics(cut) == _metrics(straight)


def test_yaml_configs_that_are_empty_or_not_utf8_are_refused(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    code, err = _cli(["run", str(empty)], monkeypatch, capsys)
    assert code == 2 and f"{empty} is empty" in err
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    code, err = _cli(["run", str(latin)], monkeypatch, capsys)
    assert code == 2 and f"{latin} is not UTF-8" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_flower_resume_uses_the_checkpoint_the_engine_fell_back_to(tmp_path):
    """The Flower runtime reads its resume point (for the clients' state history) after the
    engine chose it, so a lost LATEST resumes the clients' states too."""
    roles = {"roles": {"strong": 0.5, "weak": 0.5}}
    cfg = toy_config(tmp_path, "test-two-phase", name="full", rounds=4, clients=roles)
    flower_run(cfg, tmp_path / "nodes_full")
    part = {**cfg, "name": "part", "rounds": 2}
    flower_run(part, tmp_path / "nodes")
    (tmp_path / "part" / "checkpoints" / "LATEST").unlink()
    flower_run({**part, "rounds": 4}, tmp_path / "nodes", resume=True)
    same_run(tmp_path / "full", tmp_path / "part")
    sessions = json.loads((tmp_path / "part" / "flower_sessions.json").read_text())
    assert [s["resumed_from"] for s in sessions["sessions"]] == [-1, 2]


def test_report_names_a_damaged_file(tmp_path, monkeypatch, capsys):
    _run(tmp_path, "a", rounds=1)
    summary = (tmp_path / "a" / "summary.json").read_text()
    (tmp_path / "a" / "summary.json").write_text('{"final": ')
    code, err = _cli(["report", str(tmp_path / "a")], monkeypatch, capsys)
    assert code == 2 and "summary.json: not valid JSON" in err and "Traceback" not in err
    (tmp_path / "a" / "summary.json").write_text(summary)
    (tmp_path / "a" / "metrics.jsonl").write_bytes(b'{"round": 0}\n\xff\n{"round": 1}\n')
    code, err = _cli(["report", str(tmp_path / "a")], monkeypatch, capsys)
    assert code == 2 and "metrics.jsonl: not UTF-8" in err


def test_a_file_where_the_run_folder_would_be_is_refused(tmp_path):
    (tmp_path / "r").write_text("not a run")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        _run(tmp_path, overwrite=True)
    assert (tmp_path / "r").read_text() == "not a run"
