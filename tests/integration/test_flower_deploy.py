"""Flower's deployment engine on loopback: a SuperLink and SuperNodes as separate processes.

Each test starts its own SuperLink and two SuperNodes (each with its fedfm warm worker) on
127.0.0.1 with free ports, runs a fedfm experiment through them, compares it with the
embedded runtime (tolerance 0: metrics, audit ledger and client counters must be equal) and
stops every process it started, whatever happens. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import deploy_client as DC
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower import tls as T
from fedfm.runtime.flower.watch import checkpoint_round
from fedfm.runtime.flower.wire import Payload
from helpers import TESTS, flower, toy  # noqa: F401  (register the toy task, test algorithms)
from helpers.config import toy_config
from helpers.keys import assert_key_modes
from helpers.runfiles import untimed_rows

pytestmark = pytest.mark.slow  # several processes, about a minute each

ENV = {"PYTHONPATH": str(TESTS)}
RUN_TIMEOUT_S = 240


@contextmanager
def stopping(procs: list[P.Proc]) -> Iterator[list[P.Proc]]:
    """Stops every process in ``procs`` (appended to inside the block) on exit."""
    try:
        yield procs
    finally:
        P.stop(procs)
        for p in procs:
            assert not p.alive(), f"{p.name} still running"
            with pytest.raises(ProcessLookupError):
                os.killpg(p.popen.pid, 0)  # nothing left in its process group


def _embedded(cfg: dict) -> dict:
    return run(load_config(cfg), progress=False)


def _kill_when(path: Path, rnd: int, victims: list[P.Proc], stop: threading.Event) -> None:
    """Kills ``victims`` once ``path`` (metrics.jsonl) has logged round ``rnd``."""
    while not stop.is_set():
        if any(r["round"] >= rnd for r in untimed_rows(path)):
            P.stop(victims, grace_s=0)
            return
        time.sleep(0.05)


def test_fedavg_on_supernodes_equals_embedded_and_a_dying_supernode_fails(tmp_path):
    """`fedfm serve` (insecure) with two `fedfm client` SuperNodes: FedAvg equals the
    embedded run while both nodes live; a node killed mid-run is a failed client."""
    cfg = toy_config(tmp_path / "runs", "fedavg", name="emb", rounds=3, num_clients=2)
    _embedded(cfg)
    port = P.free_port()
    with stopping([]) as procs:
        for i in range(2):
            procs += DC.start_client(
                f"127.0.0.1:{port}", i, 2, tmp_path / f"node{i}", tmp_path / "logs", env_extra=ENV
            )
        stop = threading.Event()
        metrics = tmp_path / "runs" / "dep" / "metrics.jsonl"
        killer = threading.Thread(target=_kill_when, args=(metrics, 2, procs[2:], stop))
        killer.start()
        try:
            summary = D.serve(
                load_config({**cfg, "name": "dep", "runtime": "flower"}),
                options={"imports": ["helpers.flower"], "timeout_s": 8, "node_wait_s": 60},
                host="127.0.0.1",
                port=port,
                timeout_s=RUN_TIMEOUT_S,
                echo=False,
                work_dir=tmp_path / "serve",
            )
        finally:
            stop.set()
            killer.join(10)
        assert procs[0].alive() and not procs[2].alive()
    emb = untimed_rows(tmp_path / "runs" / "emb" / "metrics.jsonl")
    dep = untimed_rows(tmp_path / "runs" / "dep" / "metrics.jsonl")
    assert dep[:3] == emb[:3]  # rounds 0-2: both SuperNodes alive
    audit = lambda name: [  # noqa: E731
        r for r in untimed_rows(tmp_path / "runs" / name / "audit.jsonl") if r["round"] <= 2
    ]
    assert audit("dep") == audit("emb")
    assert dep[3]["failed"] == 1 and dep[3]["clients"] == 1
    fails = untimed_rows(tmp_path / "runs" / "dep" / "failures.jsonl")
    assert [(f["round"], f["client"]) for f in fails] == [(3, "1")]
    # Our reply timeout, or the SuperLink's verdict once the node misses its heartbeats.
    err = fails[0]["error"]
    assert err.startswith("client 1: no reply within") or "Node Unavailable" in err, err
    assert summary["failed_clients"] == 1


def test_tls_node_auth_multi_exchange_and_resume_equal_embedded(tmp_path):
    """TLS from generated certificates, node authentication with registered keys, a
    multi-exchange algorithm with roles and client state, interrupted after round 1 and
    resumed as a new Flower run: equal to an uninterrupted embedded run."""
    roles = {"roles": {"strong": 0.5, "weak": 0.5}}
    cfg = toy_config(tmp_path / "runs", "test-two-phase", name="emb", rounds=2, num_clients=2)
    cfg["clients"] = roles
    emb = _embedded(cfg)
    tls = T.make_certificates(tmp_path / "certs")
    keys = [T.make_node_key(tmp_path / "keys", f"node{i}") for i in range(3)]
    for folder in ("certs", "keys"):  # private keys 600, folders 700
        assert_key_modes(tmp_path / folder)
    port = P.free_port()
    home = tmp_path / "serve-home"
    with stopping([]) as procs, commands(tmp_path) as started:
        procs.append(D.start_superlink(home, tmp_path / "logs", "127.0.0.1", port, tls, True, ENV))
        D.write_connection(home, f"127.0.0.1:{port}", tls.ca_cert)
        D.register_nodes(f"127.0.0.1:{port}", tls.ca_cert, [keys[0][1], keys[1][1]])
        # Node 2's key is not registered, and a client without TLS: both are refused, say
        # why in one line and stop with code 2 (the key after a bounded wait).
        client = ["client", "--superlink", f"127.0.0.1:{port}", "--num-partitions", "2"]
        unregistered = _fedfm(started, tmp_path, "unregistered", *client, "--partition-id", "1",
                              "--root-certificates", str(tls.ca_cert), "--auth-key",
                              str(keys[2][0]), "--wait", "60")  # fmt: skip
        plain = _fedfm(started, tmp_path, "plain", *client, "--partition-id", "1", "--insecure")
        for i in range(2):
            procs += DC.start_client(
                f"127.0.0.1:{port}",
                i,
                2,
                tmp_path / f"node{i}",
                tmp_path / f"logs{i}",
                root_certificates=tls.ca_cert,
                auth_key=keys[i][0],
                env_extra=ENV,
            )
        options = {"imports": ["helpers.flower"], "timeout_s": 60, "node_wait_s": 60}
        part = load_config({**cfg, "name": "dep", "runtime": "flower", "rounds": 1})
        p1 = Payload(part.model_dump(mode="json"), options)
        D.submit(home, tmp_path, p1, RUN_TIMEOUT_S, env_extra=ENV)
        full = load_config({**cfg, "name": "dep", "runtime": "flower"})
        p2 = Payload(full.model_dump(mode="json"), options, resume=True)
        D.submit(home, tmp_path, p2, RUN_TIMEOUT_S, env_extra=ENV)
        assert plain.wait(30) == 2 and unregistered.wait(150) == 2
        assert _output(tmp_path, "plain").splitlines()[-1] == (
            "client 1: refused: the SuperLink requires TLS: start this client with"
            " --root-certificates CA_FILE"
        )
        assert re.fullmatch(
            r"client 1: gave up after \d+\.\d s \(--wait 60\): refused: node key not registered"
            r" on the SuperLink \(Flower: \[code: 2004\] Failed to activate SuperNode\.\)",
            _output(tmp_path, "unregistered").splitlines()[-1],
        )
    for log in ("metrics.jsonl", "audit.jsonl", "failures.jsonl"):
        got = untimed_rows(tmp_path / "runs" / "dep" / log)
        assert got == untimed_rows(tmp_path / "runs" / "emb" / log), log
    dep = json.loads((tmp_path / "runs" / "dep" / "summary.json").read_text())
    # Per-client counters survived the server restart through the nodes' snapshots.
    assert dep["finish"] == emb["finish"] and sum(emb["finish"].values()) == 2 * 2
    sessions = json.loads((tmp_path / "runs" / "dep" / "flower_sessions.json").read_text())
    assert [s["resumed_from"] for s in sessions["sessions"]] == [-1, 1]


# --------------------------------------------------------------------------- the commands


def _cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment of a `fedfm` command: this tree's package, the test plugins, and a
    temporary folder of its own (to check that the command removes what it made there)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    src = str(TESTS.parent / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(TESTS)]), "TMPDIR": str(tmp)}


@contextmanager
def commands(tmp_path: Path) -> Iterator[list[subprocess.Popen]]:
    """`fedfm` command processes started inside the block are killed (whole group) on exit."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _fedfm(started: list, tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    log = (tmp_path / f"{name}.log").open("wb")
    p = subprocess.Popen(
        [sys.executable, "-m", "fedfm.cli", *args],
        env=_cli_env(tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    started.append(p)
    return p


def _output(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text(errors="replace")


def _wait_for(what: str, cond: Any, timeout_s: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.2)


def _left_behind(tmp: Path) -> list[int]:
    """Processes whose environment points into ``tmp`` (a command's private folders)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if str(tmp).encode() in env.read_bytes():
                found.append(int(env.parent.name))
    return [p for p in found if p != os.getpid()]


def _stopped_cleanly(p: subprocess.Popen, sig: int, tmp: Path, prefix: str) -> int:
    """Sends ``sig``; checks that nothing the command started is left and that its temporary
    folder (the only one in ``tmp`` named ``prefix*``) is gone. Returns its exit code."""
    (own,) = tmp.glob(f"{prefix}*")
    p.send_signal(sig)
    code = p.wait(40)
    _wait_for(f"{own.name}'s processes to end", lambda: not _left_behind(own), 10)
    assert not own.exists()
    return code


def test_serve_and_client_commands_progress_absent_client_exact_audit_and_signals(tmp_path):
    """`fedfm serve` and two `fedfm client` processes for three clients (client 2 never
    comes). The server is stopped with SIGTERM after round 1 and resumed; the run shows its
    rounds, names the absent client, and audits only what reached clients 0 and 1. Then the
    clients are stopped with SIGTERM and SIGINT. Every signal ends the command with 128+N,
    one line, no processes and no temporary folder left."""
    cfg = toy_config(tmp_path / "runs", "fedavg", name="emb", rounds=3, num_clients=3)
    _embedded(cfg)
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump({**cfg, "name": "dep"}))
    port = P.free_port()
    tmp = tmp_path / "tmp"
    # Client 2 never connects, so each session waits node_wait_s in full; after the restart the
    # other two SuperNodes reconnect with Flower's retry back-off, which takes longer than 8 s
    # on a loaded machine.
    opts = ["--flower", "timeout_s=20", "--flower", "node_wait_s=30"]
    opts += ["--flower", "imports=[helpers.flower]"]
    serve = ["serve", str(path), "--insecure", "--host", "127.0.0.1", "--port", str(port), *opts]
    metrics = tmp_path / "runs" / "dep" / "metrics.jsonl"
    with commands(tmp_path) as started:
        clients = [
            _fedfm(started, tmp_path, f"client{i}", "client", "--superlink",
                   f"127.0.0.1:{port}", "--insecure", "--partition-id", str(i),
                   "--num-partitions", "3", "--state-dir", str(tmp_path / f"states{i}"))
            for i in range(2)
        ]  # fmt: skip
        server = _fedfm(started, tmp_path, "serve1", *serve)
        # A round's metrics row is written before its checkpoint: wait for both, or a SIGTERM
        # in between stops the run at round 0.
        logged = lambda: (  # noqa: E731
            any(r["round"] >= 1 for r in untimed_rows(metrics))
            and checkpoint_round(metrics.parent) >= 1
        )
        _wait_for("round 1", logged, 150, server)
        assert _stopped_cleanly(server, signal.SIGTERM, tmp, "fedfm-serve-") == 143
        out = _output(tmp_path, "serve1")
        assert re.search(r"dep: stopped by SIGTERM at round [12] of 3: continue with the same", out)
        assert "   1  rmse=" in out  # round 1 was shown as it was logged
        t0 = time.monotonic()
        server = _fedfm(started, tmp_path, "serve2", *serve, "--resume")
        assert server.wait(RUN_TIMEOUT_S) == 0, _output(tmp_path, "serve2")[-3000:]
        took = time.monotonic() - t0
        out = _output(tmp_path, "serve2")
        assert re.search(r"dep: resuming from round [12] of 3 \(", out)
        assert "   3  rmse=" in out and "rounds" in out  # the last round, then the table
        assert "\x1b[" not in out  # a log file: no colour codes
        # Flower's own lines stay in the log files the run folder keeps; fedfm's warnings
        # from the ServerApp (client 2 never came) are shown.
        for flower in ("Using SuperLink", "Successfully", "INFO", "logstream"):
            assert flower not in out, (flower, out)
        assert "no SuperNode serves client(s) 2 after 30 s: they count as failed" in out
        kept = list((tmp_path / "runs" / "dep" / "flower_logs").glob("*/flwr-run.log"))
        assert len(kept) == 2 and all("Successfully started run" in p.read_text() for p in kept)
        summary = json.loads((tmp_path / "runs" / "dep" / "summary.json").read_text())
        # The session's start (the SuperLink, the ServerApp and the wait of node_wait_s for
        # client 2) and its rounds are timed apart.
        assert summary["start_s_this_session"] >= 30
        assert summary["start_s_this_session"] + summary["wall_s_this_session"] <= took
        folder = (tmp_path / "runs" / "dep").resolve()
        line = f"dep: rmse={summary['final']['rmse']:.4f} after 3 rounds  ->  {folder}"
        assert out.rstrip().endswith(line)
        assert "clients that took no part: 2 (never connected)" in out
        assert not _left_behind(tmp / "fedfm-serve-") and not list(tmp.glob("fedfm-serve-*"))
        # The clients: SIGTERM and SIGINT.
        for i, (sig, code) in enumerate(((signal.SIGTERM, 143), (signal.SIGINT, 130))):
            own = tmp / re.findall(r"fedfm-client-\w+", _output(tmp_path, f"client{i}"))[0]
            assert _stopped_cleanly(clients[i], sig, tmp, own.name) == code
        for i, sig in ((0, "SIGTERM"), (1, "SIGINT")):
            _check_client_lines(_output(tmp_path, f"client{i}"), i, sig)
    # The audit holds what reached clients 0 and 1: the fields of the embedded run (with all
    # three clients) for those two. Tensor sizes are equal; a JSON meta value's size follows
    # its value, which differs once the model is averaged over two clients instead of three.
    emb = untimed_rows(tmp_path / "runs" / "emb" / "audit.jsonl")
    dep = untimed_rows(tmp_path / "runs" / "dep" / "audit.jsonl")
    shape = lambda rows: [  # noqa: E731
        {k: v for k, v in a.items() if a["type"] == "arrays" or k != "bytes"} for a in rows
    ]
    assert shape(dep) == shape([a for a in emb if a["client"] != "2"])
    assert {a["client"] for a in dep} == {"0", "1"}
    for r in untimed_rows(metrics):
        down = [a["bytes"] for a in dep if a["round"] == r["round"] and a["direction"] == "down"]
        assert r["bytes_down"] == sum(down)
    fails = untimed_rows(tmp_path / "runs" / "dep" / "failures.jsonl")
    assert {(f["client"], f["delivery"]) for f in fails} == {("2", "not sent")}
    assert [f["round"] for f in fails] == [1, 2, 3]  # asked every round, never sent


def _check_client_lines(out: str, cid: int, sig: str) -> None:
    """A client that served two sessions says so in one line each, and nothing else: no
    traceback, no Flower or uvicorn log lines, no colour codes."""
    assert "Traceback" not in out and "INFO" not in out and "\x1b[" not in out, out
    lines = [x.removeprefix(f"client {cid}: ") for x in out.splitlines()]
    assert lines[0].startswith("waiting for the server (nothing answers at 127.0.0.1:")
    # The logs folder is named once a SuperNode writes there, and said to go at the end.
    assert lines[1].startswith("SuperNode for 127.0.0.1:") and lines[1].endswith(
        "while this client runs"
    )
    first = lines.index("connected")
    second = lines.index("connected", first + 1)
    assert "served round 1" in lines[first:second]
    assert lines[second - 1] == "server session ended; waiting for the next"
    assert "served round 3" in lines[second:]
    assert "connected" not in lines[second + 1 :]  # no more restarts once it served
    # FedAvg keeps no client state: no snapshot folder to name.
    assert lines[-1] == (
        f"stopped by {sig} (SuperNode and worker stopped); run the same command to rejoin"
    )
    assert all(
        x.startswith(("SuperNode for", "waiting for the server", "served round", "stopped by"))
        or x in ("connected", "server session ended; waiting for the next")
        for x in lines
    ), lines


def test_serve_stopped_by_ctrl_c_before_round_0_exits_130_and_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT) while the server waits for its SuperNodes: exit 130, one line saying
    that nothing can be resumed yet, no process and no temporary folder left."""
    cfg = toy_config(tmp_path / "runs", "fedavg", name="dep", rounds=2, num_clients=2)
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = P.free_port()
    serve = ["serve", str(path), "--insecure", "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--flower", "node_wait_s=120", "--flower", "imports=[helpers.flower]"]
    with commands(tmp_path) as started:
        server = _fedfm(started, tmp_path, "serve", *serve)
        # The ServerApp has started once it waits for SuperNodes in the run folder it made.
        made = lambda: (tmp_path / "runs" / "dep" / "flower_sessions.json").exists()  # noqa: E731
        _wait_for("the ServerApp", made, 120, server)
        assert _stopped_cleanly(server, signal.SIGINT, tmp_path / "tmp", "fedfm-serve-") == 130
    # The ServerApp's run folder goes with a run stopped before round 0: none is named.
    assert _output(tmp_path, "serve").splitlines()[-1] == (
        "dep: stopped by SIGINT before round 0 (no run folder is left): start it again with the"
        " same command"
    )
    assert not (tmp_path / "runs" / "dep").exists()
