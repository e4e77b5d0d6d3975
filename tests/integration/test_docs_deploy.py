"""The command blocks of docs/running-across-machines.md, run as written on loopback.

Every ``bash`` block of the page is marked ``<!-- docs-test: run -->`` (this test runs it),
``<!-- docs-test: server ... -->`` and ``<!-- docs-test: client ... -->`` (the two-machine
pair: run together on loopback), or ``<!-- docs-test: skip (why) -->`` (placeholders stand
in it). The runnable blocks run one after the other in one folder, each with ``bash -e`` and
a time limit, with these substitutions only: free ports for the fixed ones (9092, 9093,
9110, 9111), this interpreter's environment for ``/opt/fedfm-venv``, and a folder of the
test for ``/tmp/fedfm-states``. Whatever a block leaves running is killed at the end.

The two-machine pair runs as written with the certificate the page makes (for
``server.example.org`` and ``10.0.0.5``; ``fedfm flower-certs`` adds the loopback names):
the server block in a folder of its own holding ``certs``, and the client block three
times, as clients 0, 1 and 2, each in a folder holding its ``ca.crt`` and ``node<i>.key``,
with ``127.0.0.1`` for ``server.example.org`` (a name only DNS could map here) and a test
folder for ``/var/lib/fedfm``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedfm.runtime.flower import processes as P
from helpers import REPO
from helpers.keys import assert_key_modes
from helpers.runfiles import untimed_rows

pytestmark = pytest.mark.slow  # two deployments on loopback, about two minutes

DOC = REPO / "docs" / "running-across-machines.md"
BLOCK = re.compile(
    r"(?:<!-- docs-test: (run|server|client|skip)[^>]*-->\n)?```bash\n(.*?)```", re.S
)
PORTS = ("9092", "9093", "9110", "9111")
BLOCK_TIMEOUT_S = 300


def blocks() -> list[tuple[str, str]]:
    """``(mark, text)`` of every bash block of the page; mark is ``run``, ``server``,
    ``client``, ``skip`` or ''."""
    return [(m.group(1) or "", m.group(2)) for m in BLOCK.finditer(DOC.read_text())]


def test_every_command_block_is_marked():
    found = blocks()
    assert len(found) >= 8
    unmarked = [text.splitlines()[0] for mark, text in found if not mark]
    assert not unmarked, f"bash blocks without a docs-test mark: {unmarked}"
    assert sum(mark == "run" for mark, _ in found) >= 5


def _options(text: str) -> set[str]:
    """The ``--options`` of a command block (line continuations joined)."""
    return set(re.findall(r"(?<!\S)--[a-z-]+", text))


def test_the_resume_command_is_the_serve_command_with_resume():
    """Copied as written, the documented resume listens where the run's server did (it
    used to leave out --host and --port: 0.0.0.0 and the default port)."""
    found = [text for _, text in blocks()]
    serve = next(t for t in found if t.startswith("fedfm serve") and "--resume" not in t)
    resume = next(t for t in found if t.startswith("fedfm serve") and "--resume" in t)
    assert _options(resume) == _options(serve) | {"--resume"}
    overrides = lambda t: {w for w in t.split() if "=" in w and not w.startswith("-")}  # noqa: E731
    assert overrides(resume) == overrides(serve)


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


#: Flower's own lines, which stay in the log files and never reach a command's output.
FLOWER_LINES = ("Using SuperLink", "Successfully", "INFO :", "logstream")


def _start_block(text: str, cwd: Path, env: dict[str, str], name: str) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    with (cwd / f"{name}.out").open("w") as out:
        return subprocess.Popen(
            ["bash", "-e", "-c", text], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True,
        )  # fmt: skip


def _two_machines(server: str, client: str, work: Path, env: dict[str, str], tmp: Path) -> str:
    """The server block with the client block as clients 0, 1 and 2, all on loopback; the
    server's output."""
    shutil.copytree(work / "certs", work / "server" / "certs")
    procs = [_start_block(server, work / "server", env, "serve")]
    try:
        for i in range(3):
            machine = work / f"client-machine{i}"
            machine.mkdir()
            for name in ("ca.crt", f"node{i}.key"):
                shutil.copy2(work / "certs" / name, machine / name)
            text = client.replace("server.example.org", "127.0.0.1")
            text = text.replace("node0.key", f"node{i}.key").replace("/var/lib/fedfm", str(tmp))
            text = re.sub(r"--partition-id 0\b", f"--partition-id {i}", text)
            procs.append(_start_block(text, machine, env, "client"))
        code = procs[0].wait(BLOCK_TIMEOUT_S)
        out = (work / "server" / "serve.out").read_text()
        assert code == 0, f"{server}\n--- exit {code}:\n{out[-4000:]}"
        return out
    finally:  # the clients (and anything left): SIGTERM to each block and what it started
        for p in procs:
            P.stop([P.Proc("block", p, work / "unused.log")], grace_s=10)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def test_the_runnable_blocks_run_as_written(tmp_path):
    ports = {p: str(P.free_port()) for p in PORTS}
    bin_dir = str(Path(sys.executable).parent)
    src = str(REPO / "src")
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
    pending_server = ""
    for mark, text in blocks():
        if mark == "server":
            pending_server = _substituted(text, ports, tmp_path / "states")
            continue
        if mark == "client":
            client = _substituted(text, ports, tmp_path / "states")
            out = _two_machines(pending_server, client, work, env, tmp_path / "client-states")
            assert not [x for x in FLOWER_LINES if x in out], out
            assert out.rstrip().splitlines()[-1].startswith("tabular-fedavg: acc=")
            summary = json.loads((work / "server" / "runs/tabular-fedavg/summary.json").read_text())
            assert summary["rounds"] == 20 and summary["failed_clients"] == 0
            continue
        if mark != "run":
            continue
        before = _files(work / "certs")
        done = _run_block(_substituted(text, ports, tmp_path / "states"), work, env)
        assert done.returncode == 0, f"{text}\n--- exit {done.returncode}:\n{done.stdout[-4000:]}"
        if "fedfm serve" in text:  # (a block of Flower's own commands prints Flower's lines)
            assert not [x for x in FLOWER_LINES if x in done.stdout], done.stdout
        if "--renew" in text:  # new CA and certificate, the node keys as they were
            after = _files(work / "certs")
            assert {k: v for k, v in after.items() if k.startswith("node")} == {
                k: v for k, v in before.items() if k.startswith("node")
            }
            assert all(after[k] != before[k] for k in ("ca.crt", "server.pem", "server.key"))
            assert "valid until" in done.stdout
    # Key material: three nodes, then two added; private keys 600 in a 700 folder.
    assert sorted(p.name for p in (work / "certs").glob("node*.key")) == [
        f"node{i}.key" for i in range(5)
    ]
    assert_key_modes(work / "certs")
    assert_key_modes(work / "local-certs")
    # The one-machine deployment equals the embedded run, as the page says.
    dep = untimed_rows(work / "runs" / "tabular-fedavg" / "metrics.jsonl")
    assert len(dep) == 4 and dep == untimed_rows(work / "runs" / "emb" / "metrics.jsonl")
    # The run submitted with Flower's own commands finished.
    summary = json.loads((work / "runs" / "existing" / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["failed_clients"] == 0
    # The SecAgg+ deployment: one masked vector per client and round, nothing else summed.
    secagg = (work / "runs" / "secagg" / "audit.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in secagg]
    train_up = [r["field"] for r in rows if r["kind"] == "train" and r["direction"] == "up"]
    assert train_up == ["masked"] * 6
    # The fedfm commands cleaned up their temporary folders (torch leaves an empty
    # torchinductor_<user> cache folder of its own there when fedfm's engine is imported).
    assert not list((tmp_path / "tmp").glob("fedfm-*"))
