"""A run killed with SIGKILL mid-run and resumed ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fedfm.config import load_config
from fedfm.runtime import run

TESTS = Path(__file__).parent


def _cfg(out: Path, name: str) -> dict:
    return {
        "name": name,
        "algorithm": "fedavg",
        "rounds": 12,
        "seed": 3,
        "task": {"kind": "toy", "num_clients": 6},
        "algo": {"server_opt": {"name": "fedadam", "lr": 0.05}},
        "clients": {"fraction": 0.5},
        "train": {"steps": 150, "batch_size": 8, "lr": 0.02, "optimizer": "adam"},
        "out_dir": str(out),
        "plots": False,
    }


def _metrics(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("time_s")
    return rows


def kill_mid_run(cfg: dict, folder: Path, rows: int = 4) -> None:
    """Runs ``cfg`` in a child process and kills it with SIGKILL once ``folder`` logs ``rows``
    rounds (a toy-task config; the test fails if the run ends first)."""
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(TESTS)!r})
        import toy
        from fedfm.config import load_config
        from fedfm.runtime import run
        run(load_config({cfg!r}), progress=False)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    metrics = folder / "metrics.jsonl"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
                break
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_kill_9_then_resume_is_bit_identical(tmp_path):
    import toy  # noqa: F401

    run(load_config(_cfg(tmp_path, "straight")), progress=False)
    kill_mid_run(_cfg(tmp_path, "killed"), tmp_path / "killed")
    assert not (tmp_path / "killed" / "summary.json").exists()
    done = len(_metrics(tmp_path / "killed"))
    assert 4 <= done < 13

    run(load_config(_cfg(tmp_path, "killed")), resume=True, progress=False)
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "killed")
    assert straight == resumed  # every round, every metric, exactly
    a = json.loads((tmp_path / "straight" / "summary.json").read_text())["final"]
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())["final"]
    assert a == b
    # The audit ledger holds each round exactly once after the resume.
    audit = [json.loads(x) for x in (tmp_path / "killed" / "audit.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "straight" / "audit.jsonl").read_text().splitlines()]
    assert audit == ref
