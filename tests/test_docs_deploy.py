"""The command blocks of docs/running-across-machines.md, run as written on loopback.

Every ``bash`` block of the page is marked ``<!-- docs-test: run -->`` (this test runs it) or
``<!-- docs-test: skip (why) -->`` (it needs other machines, or placeholders stand in it). The
runnable blocks run one after the other in one folder, each with ``bash -e`` and a time
limit, with these substitutions only: free ports for the fixed ones (9092, 9093, 9110,
9111), this interpreter's environment for ``/opt/fedfm-venv``, and a folder of the test for
``/tmp/fedfm-states``. Whatever a block leaves running is killed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import flower_support as fs
from fedfm.runtime.flower import processes as P
from test_flower_ops import assert_key_modes

pytestmark = pytest.mark.slow  # two deployments on loopback, about two minutes

DOC = Path(__file__).parent.parent / "docs" / "running-across-machines.md"
BLOCK = re.compile(r"(?:<!-- docs-test: (run|skip[^>]*) -->\n)?```bash\n(.*?)```", re.S)
PORTS = ("9092", "9093", "9110", "9111")
BLOCK_TIMEOUT_S = 300


def blocks() -> list[tuple[str, str]]:
    """``(mark, text)`` of every bash block of the page; mark is ``run``, ``skip ...`` or ''."""
    return [(m.group(1) or "", m.group(2)) for m in BLOCK.finditer(DOC.read_text())]


def test_every_command_block_is_marked():
    found = blocks()
    assert len(found) >= 8
    unmarked = [text.splitlines()[0] for mark, text in found if not mark]
    assert not unmarked, f"bash blocks without a docs-test mark: {unmarked}"
    assert sum(mark == "run" for mark, _ in found) >= 5


def _substituted(text: str, ports: dict[str, str], states: Path) -> str:
    for fixed, free in ports.items():
        text = re.sub(rf"\b{fixed}\b", free, text)
    text = text.replace("/opt/fedfm-venv", sys.prefix)
    return text.replace("/tmp/fedfm-states", str(states))


def _run_block(text: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        ["bash", "-e", "-c", text],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        # Anything the block left behind (background jobs and what they started).
        P.stop([P.Proc("block", proc, cwd / "unused.log")], grace_s=3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(text, proc.returncode, out)


def test_the_runnable_blocks_run_as_written(tmp_path):
    ports = {p: str(P.free_port()) for p in PORTS}
    bin_dir = str(Path(sys.executable).parent)
    src = str(Path(__file__).parent.parent / "src")
    (tmp_path / "tmp").mkdir()
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": src,  # this tree's fedfm, also for the `fedfm` entry point
        "TMPDIR": str(tmp_path / "tmp"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_HOME": str(tmp_path / "default-flwr-home"),
    }
    env.pop("VIRTUAL_ENV", None)
    work = tmp_path / "work"
    work.mkdir()
    for mark, text in blocks():
        if mark != "run":
            continue
        done = _run_block(_substituted(text, ports, tmp_path / "states"), work, env)
        assert done.returncode == 0, f"{text}\n--- exit {done.returncode}:\n{done.stdout[-4000:]}"
    # Key material: three nodes, then two added; private keys 600 in a 700 folder.
    assert sorted(p.name for p in (work / "certs").glob("node*.key")) == [
        f"node{i}.key" for i in range(5)
    ]
    assert_key_modes(work / "certs")
    assert_key_modes(work / "local-certs")
    # The one-machine deployment equals the embedded run, as the page says.
    dep = fs.read_jsonl(work / "runs" / "tabular-fedavg" / "metrics.jsonl")
    assert len(dep) == 4 and dep == fs.read_jsonl(work / "runs" / "emb" / "metrics.jsonl")
    # The run submitted with Flower's own commands finished.
    summary = json.loads((work / "runs" / "existing" / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["failed_clients"] == 0
    assert not list((tmp_path / "tmp").iterdir())  # the fedfm commands cleaned up
