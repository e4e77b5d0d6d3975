"""Runs in a child process, killed mid-run (what a crash or a kill -9 leaves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import TESTS


def kill_mid_run(cfg: dict, folder: Path, rows: int = 4) -> None:
    """Runs ``cfg`` in a child process and kills it with SIGKILL once ``folder`` logs ``rows``
    rounds (a toy-task config; the test fails if the run ends first)."""
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(TESTS)!r})
        import helpers.toy
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
