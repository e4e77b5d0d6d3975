"""Flower's deployment engine on loopback: a SuperLink and SuperNodes as separate processes.

Each test starts its own SuperLink and two SuperNodes (each with its fedfm warm worker) on
127.0.0.1 with free ports, runs a fedfm experiment through them, compares it with the
embedded runtime (tolerance 0: metrics, audit ledger and client counters must be equal) and
stops every process it started, whatever happens. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import flower_support as fs
from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower import tls as T
from fedfm.runtime.flower.wire import Payload

pytestmark = pytest.mark.slow  # several processes, about a minute each

TESTS = Path(__file__).parent
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
        if any(r["round"] >= rnd for r in fs.read_jsonl(path)):
            P.stop(victims, grace_s=0)
            return
        time.sleep(0.05)


def test_fedavg_on_supernodes_equals_embedded_and_a_dying_supernode_fails(tmp_path):
    """`fedfm serve` (insecure) with two `fedfm client` SuperNodes: FedAvg equals the
    embedded run while both nodes live; a node killed mid-run is a failed client."""
    cfg = fs.config(tmp_path / "runs", "fedavg", name="emb", rounds=3, num_clients=2)
    _embedded(cfg)
    port = P.free_port()
    with stopping([]) as procs:
        for i in range(2):
            procs += D.start_client(
                f"127.0.0.1:{port}", i, 2, tmp_path / f"node{i}", tmp_path / "logs", env_extra=ENV
            )
        stop = threading.Event()
        metrics = tmp_path / "runs" / "dep" / "metrics.jsonl"
        killer = threading.Thread(target=_kill_when, args=(metrics, 2, procs[2:], stop))
        killer.start()
        try:
            summary = D.serve(
                load_config({**cfg, "name": "dep", "runtime": "flower"}),
                options={"imports": ["flower_support"], "timeout_s": 8, "node_wait_s": 60},
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
    emb = fs.read_jsonl(tmp_path / "runs" / "emb" / "metrics.jsonl")
    dep = fs.read_jsonl(tmp_path / "runs" / "dep" / "metrics.jsonl")
    assert dep[:3] == emb[:3]  # rounds 0-2: both SuperNodes alive
    audit = lambda name: [  # noqa: E731
        r for r in fs.read_jsonl(tmp_path / "runs" / name / "audit.jsonl") if r["round"] <= 2
    ]
    assert audit("dep") == audit("emb")
    assert dep[3]["failed"] == 1 and dep[3]["clients"] == 1
    fails = fs.read_jsonl(tmp_path / "runs" / "dep" / "failures.jsonl")
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
    cfg = fs.config(tmp_path / "runs", "test-two-phase", name="emb", rounds=2, num_clients=2)
    cfg["clients"] = roles
    emb = _embedded(cfg)
    tls = T.make_certificates(tmp_path / "certs")
    keys = [T.make_node_key(tmp_path / "keys", f"node{i}") for i in range(3)]
    port = P.free_port()
    home = tmp_path / "serve-home"
    with stopping([]) as procs:
        procs.append(D.start_superlink(home, tmp_path / "logs", "127.0.0.1", port, tls, True, ENV))
        D.write_connection(home, f"127.0.0.1:{port}", tls.ca_cert)
        D.register_nodes(home, [keys[0][1], keys[1][1]], tmp_path, ENV)
        for i in range(3):  # node 2's key is not registered: the SuperLink refuses it
            procs += D.start_client(
                f"127.0.0.1:{port}",
                min(i, 1),
                2,
                tmp_path / f"node{i}",
                tmp_path / f"logs{i}",
                root_certificates=tls.ca_cert,
                auth_key=keys[i][0],
                env_extra=ENV,
            )
        options = {"imports": ["flower_support"], "timeout_s": 60, "node_wait_s": 60}
        part = load_config({**cfg, "name": "dep", "runtime": "flower", "rounds": 1})
        p1 = Payload(part.model_dump(mode="json"), options)
        D.submit(home, tmp_path, p1, RUN_TIMEOUT_S, env_extra=ENV)
        full = load_config({**cfg, "name": "dep", "runtime": "flower"})
        p2 = Payload(full.model_dump(mode="json"), options, resume=True)
        D.submit(home, tmp_path, p2, RUN_TIMEOUT_S, env_extra=ENV)
        unregistered = procs[-2]
        assert not unregistered.alive() and "Failed to activate SuperNode" in unregistered.tail()
    for log in ("metrics.jsonl", "audit.jsonl", "failures.jsonl"):
        got = fs.read_jsonl(tmp_path / "runs" / "dep" / log)
        assert got == fs.read_jsonl(tmp_path / "runs" / "emb" / log), log
    dep = json.loads((tmp_path / "runs" / "dep" / "summary.json").read_text())
    # Per-client counters survived the server restart through the nodes' snapshots.
    assert dep["finish"] == emb["finish"] and sum(emb["finish"].values()) == 2 * 2
    sessions = json.loads((tmp_path / "runs" / "dep" / "flower_sessions.json").read_text())
    assert [s["resumed_from"] for s in sessions["sessions"]] == [-1, 1]
