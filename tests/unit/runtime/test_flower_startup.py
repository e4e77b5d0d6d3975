"""What fedfm starts ahead of a deployed run: serve's ServerApp process, a client's worker.

Fast tests with stand-in processes; the loopback runs are in
``tests/integration/test_flower_deploy.py``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest

from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import deploy_client as DC
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower import startup as S


def _sleeper(tmp_path, name: str) -> P.Proc:
    return P.start(name, [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path)


def test_serve_runs_its_superlink_without_a_superexec_of_its_own():
    cmd = D.superlink_command("127.0.0.1", 9092, isolation="process")
    assert cmd[cmd.index("--isolation") + 1] == "process"
    assert "--isolation" not in D.superlink_command("127.0.0.1", 9092)  # Flower's default
    # One command for the client's worker, started ahead or with its SuperNode.
    assert DC.worker_command(5, 6) == S.worker_command(5, 6)


def test_a_server_worker_that_ended_before_the_run_is_one_error_naming_its_output(tmp_path):
    gone = subprocess.Popen(
        [sys.executable, "-c", "print('ImportError: no torch'); raise SystemExit(3)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = gone.communicate(timeout=30)
    early = tempfile.TemporaryFile()  # noqa: SIM115 (closed by cancel)
    early.write(out)
    worker = S.ServerWorker(gone, early)
    with pytest.raises(P.DeployError, match=r"the ServerApp process exited \(3\):\nImportError"):
        worker.go("127.0.0.1:1", None, {}, [], tmp_path / "logs")
    worker.cancel()


def test_a_cancelled_server_worker_is_gone_and_a_handed_one_is_left_to_serve(tmp_path):
    worker = S.ServerWorker.start(die_with_parent=False)
    worker.cancel()
    assert worker.popen.returncode is not None  # killed while it imported
    running = S.ServerWorker(
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE
        ),
        tempfile.TemporaryFile(),  # noqa: SIM115 (closed by cancel)
    )
    proc = running.go("127.0.0.1:1", None, {}, [], tmp_path / "logs")
    assert proc.log_path == tmp_path / "logs" / "serverapp.log" and proc.log_path.exists()
    running.cancel()  # handed the run: serve stops it with the SuperLink, not here
    assert proc.popen.wait(30) == 0  # it read its line and ended by itself


class _FlwrRun:
    """A ``flwr run`` that would go on for a minute (what :func:`S.wait_run` calls)."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()

    def wait(self, timeout_s: float | None) -> str:
        self.popen.wait(timeout_s)
        return ""


def test_a_run_whose_serverapp_process_died_fails_instead_of_waiting(tmp_path, monkeypatch):
    """Without Flower's SuperExec nothing reports a ServerApp process that died: serve does."""
    monkeypatch.setattr(S, "AFTER_SERVERAPP_S", 0.3)
    code = "print('killed'); raise SystemExit(9)"
    dead = P.start("serverapp", [sys.executable, "-c", code], {}, tmp_path)
    dead.popen.wait(30)
    hanging = _FlwrRun()
    t0 = time.monotonic()
    with pytest.raises(P.DeployError, match=r"the ServerApp process exited \(9\) before the run"):
        S.wait_run(hanging, dead, 60)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 10 and hanging.popen.poll() is not None


def test_a_worker_started_ahead_serves_the_next_supernode_when_the_first_was_refused(tmp_path):
    ahead = S.WorkerAhead()
    with ahead:
        worker = S.WarmWorker(_sleeper(tmp_path, "w"), 1234, 1235)
        ahead.worker = worker
        node = _sleeper(tmp_path, "node")
        assert ahead.take() is worker and ahead.worker is None
        # Refused before it connected: only the SuperNode stops, the worker waits again.
        assert ahead.after([node, worker.proc], connected=False) == [node]
        assert ahead.worker is worker and ahead.take() is worker
        # Once connected (a session ran), the worker goes with its SuperNode.
        assert ahead.after([node, worker.proc], connected=True) == [node, worker.proc]
        assert ahead.worker is None
        ahead.worker = S.WarmWorker(_sleeper(tmp_path, "w2"), 1, 2)
        P.stop([node, worker.proc])
    assert ahead.worker is None  # the one not taken was stopped on the way out


def test_a_client_starts_its_worker_while_it_waits_for_the_first_session(tmp_path, monkeypatch):
    started: list[tuple] = []
    procs: list[P.Proc] = []

    def fake_ahead(home, log_dir, name, **kw):
        started.append((name, kw))
        procs.append(_sleeper(tmp_path, name))
        return S.WarmWorker(procs[-1], 1, 2)

    monkeypatch.setattr(S, "start_warm_worker", fake_ahead)
    port = P.free_port()  # nothing listens there
    assert DC.client(f"127.0.0.1:{port}", 3, 4, work_dir=tmp_path, wait_s=1.0) == 2
    assert started == [("supernode-3", {"die_with_parent": True})]  # once, not per probe
    assert not procs[0].alive()  # stopped when the client gave up
    started.clear()
    assert DC.client(f"127.0.0.1:{port}", 3, 4, work_dir=tmp_path, wait_s=0.5,
                    isolation="subprocess") == 2  # fmt: skip
    assert started == []  # no worker in Flower's own isolation
