"""The C allocator of a training command: when ``fedfm`` starts again with jemalloc preloaded,
and what a run records of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from fedfm import allocator
from fedfm.allocator import AllocatorError, relaunch_env
from helpers import REPO
from helpers.cli import run_cli
from helpers.config import toy_yaml

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def test_a_training_command_on_glibc_starts_again_with_jemalloc_preloaded() -> None:
    env = relaunch_env(["fedfm", "run", "quickstart"], {"PATH": "/bin"}, LIB, glibc=True)
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB}
    # A library the user preloads stays, after jemalloc; options before the command count not.
    env = relaunch_env(["fedfm", "-v", "reproduce", "x"], {"LD_PRELOAD": "/a.so"}, LIB, True)
    assert env is not None and env["LD_PRELOAD"] == f"{LIB}:/a.so"


@pytest.mark.parametrize(
    ("argv", "env", "lib", "glibc"),
    [
        (["fedfm", "plan", "quickstart"], {}, LIB, True),  # not a training command
        (["fedfm", "run", "q"], {"FEDFM_ALLOCATOR": "system"}, LIB, True),  # the user's choice
        (["fedfm", "run", "q"], {}, LIB, False),  # another C library
        (["fedfm", "run", "q"], {"LD_PRELOAD": LIB}, LIB, True),  # started again already
        (["fedfm", "run", "q"], {}, None, True),  # not installed: as before
    ],
)
def test_when_the_command_goes_on_as_it_is(argv, env, lib, glibc) -> None:
    assert relaunch_env(argv, env, lib, glibc) is None


def test_a_bad_or_unmet_choice_is_one_error() -> None:
    with pytest.raises(AllocatorError, match=r"FEDFM_ALLOCATOR='tc': expected one of auto, "):
        relaunch_env(["fedfm", "plan"], {"FEDFM_ALLOCATOR": "tc"}, LIB, True)
    with pytest.raises(AllocatorError, match=r"no libjemalloc\.so\.2 \(Debian: libjemalloc2\)"):
        relaunch_env(["fedfm", "run", "q"], {"FEDFM_ALLOCATOR": "jemalloc"}, None, True)


def test_the_command_line_refuses_a_bad_choice_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FEDFM_ALLOCATOR", "tcmalloc")
    monkeypatch.setattr(allocator, "command_process", lambda: True)
    code, out, err = run_cli(["run", str(toy_yaml(tmp_path))], monkeypatch, capsys)
    assert code == 2 and (out + err).strip().splitlines() == [
        "error: FEDFM_ALLOCATOR='tcmalloc': expected one of auto, system, jemalloc"
    ]


def test_a_program_calling_the_entry_point_in_its_own_process_is_never_replaced() -> None:
    assert not allocator.command_process()  # pytest's process


@pytest.mark.skipif(allocator.find_jemalloc() is None, reason="jemalloc is not installed")
def test_fedfm_run_starts_again_with_jemalloc_and_its_summary_says_so(tmp_path) -> None:
    config = tmp_path / "tiny.yaml"
    run = {
        "name": "tiny",
        "rounds": 1,
        "plots": False,
        "task": {"kind": "tabular", "dataset": "breast_cancer", "model_args": {"hidden": [8]}},
        "partition": {"scheme": "iid", "num_clients": 2},
        "train": {"steps": 1, "batch_size": 16},
    }
    config.write_text(yaml.safe_dump(run))
    got = {}
    for choice in ("auto", "system"):
        env = {**os.environ, "FEDFM_ALLOCATOR": choice, "PYTHONPATH": str(REPO / "src")}
        out = tmp_path / choice
        argv = [sys.executable, "-m", "fedfm", "run", str(config), "-q"]
        done = subprocess.run([*argv, f"out_dir={out}"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(next(out.rglob("summary.json")).read_text())
        got[choice] = summary["compute"]["allocator"]
    assert got == {"auto": "jemalloc", "system": "system"}
