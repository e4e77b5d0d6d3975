"""Seconds that Flower's deployment engine adds to each exchange, and an idle SuperNode's memory.

Workload: the ``tabular-fedavg`` preset (FedAvg, an MLP of 6.3 k parameters on the breast
cancer set, 10 local steps, personal evaluation: two exchanges a round, ``train`` and
``evaluate``), run once by the embedded runtime and once on a SuperLink with N SuperNodes
on 127.0.0.1 (each with its fedfm warm worker), for N = 3 and 10. The work per exchange is a
few milliseconds, so what a deployment round costs beyond the embedded one is the
runtime's own: message transport and the waits between polls.

Overhead per exchange = (the deployment's round times - the embedded round times) / the
exchanges of those rounds, over rounds 2..R (the engine's ``time_s`` of each round in
``metrics.jsonl``; round 0 is the evaluation before training, round 1 includes each
worker's task build on its first message). The start-up (SuperLink, ``flwr run``, the
ServerApp process, handshakes) is reported apart, as the wall time outside the rounds.

Idle memory: the resident set of SuperNode 0 (the SuperNode process with its children, and
its warm worker), its peak over one second sampled every 0.2 s, once when the worker
is ready and no run has started, and once after the run (the worker keeps the task it
built).

CPU: the CPU seconds per exchange of those rounds spent by the deployment's processes, by
part (the server's: SuperLink, ServerApp and the ``flwr`` CLI; the SuperNodes; their
workers), to tell waiting from work on a loaded machine.

``--supernode flower`` runs Flower's own ``flower-supernode`` (3 s between empty polls)
instead of fedfm's paced one, to measure what the pacing saves. The figures are printed
last, with the machine's load average.

Usage: .venv/bin/python benchmarks/deploy_overhead.py [--nodes 3 10] [--rounds 8]
       [--supernode fedfm|flower]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import processes as P
from vs_flower import PeakRss  # this folder: the script's own

PRESET = "tabular-fedavg"


def overrides(out: str, name: str, nodes: int, rounds: int) -> list[str]:
    """The preset with ``nodes`` clients, all of them taking part in every round."""
    return [
        f"name={name}",
        f"out_dir={out}",
        f"rounds={rounds}",
        f"partition.num_clients={nodes}",
        "clients.min_clients=1",
        "plots=false",
    ]


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exchanges(run_dir: Path, first: int) -> int:
    """Exchanges from round ``first`` on: the (round, kind) pairs the audit ledger holds."""
    pairs = set()
    for line in (run_dir / "audit.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["direction"] == "down" and row["round"] >= first:
            pairs.add((row["round"], row["kind"]))
    return len(pairs)


def round_seconds(run_dir: Path, first: int) -> float:
    return sum(r["time_s"] for r in rows(run_dir) if r["round"] >= first)


def final(run_dir: Path) -> dict[str, Any]:
    return {k: v for k, v in rows(run_dir)[-1].items() if k != "time_s"}


def idle_rss(procs: list[P.Proc]) -> list[float]:
    """Peak over one second of each process tree's resident MiB (SuperNode, worker)."""
    with PeakRss({"node": [p.popen.pid for p in procs]}) as mem:
        time.sleep(1.0)
    return [b / 2**20 for b in mem.parts["node"]]


def wait_ready(worker: P.Proc, timeout_s: float = 300.0) -> None:
    """Waits until the warm worker has imported fedfm and serves its runtime API."""
    deadline = time.monotonic() + timeout_s
    while "fedfm worker serving" not in worker.tail(50):
        if not worker.alive() or time.monotonic() > deadline:
            raise SystemExit(f"worker not ready:\n{worker.tail(20)}")
        time.sleep(0.2)


class RoundsCpu:
    """CPU seconds the deployment's processes spend in rounds 2..R, by part.

    Watches ``metrics.jsonl``: the processes below this one (SuperLink, ServerApp, the
    ``flwr`` CLI; SuperNodes; workers) are read when round 1's line appears and again when
    the last round's does.

    Args:
        run_dir: The deployment run's folder.
        rounds: Its rounds.
        parts: Process id -> part name for the SuperNodes and workers (others: ``server``).
    """

    def __init__(self, run_dir: Path, rounds: int, parts: dict[int, str]) -> None:
        self.run_dir, self.rounds, self.parts = run_dir, rounds, parts
        self.reads: list[dict[int, tuple[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> dict[int, tuple[str, float]]:
        out = {}
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                out[p.pid] = (self.parts.get(p.pid, "server"), t.user + t.system)
        return out

    def _watch(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        for lines in (2, self.rounds + 1):  # round 0 and round 1 done; the last round done
            while not self._stop.is_set():
                if path.exists() and len(path.read_text().splitlines()) >= lines:
                    self.reads.append(self._read())
                    break
                self._stop.wait(0.05)

    def per_part(self) -> dict[str, float]:
        """Part -> CPU seconds between the two reads (processes alive at both)."""
        if len(self.reads) < 2:
            return {}
        (a, b), out = self.reads, {}
        for pid, (part, secs) in b.items():
            if pid in a:
                out[part] = out.get(part, 0.0) + secs - a[pid][1]
        return out

    def __enter__(self) -> RoundsCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(out: str, nodes: int, rounds: int, paced: bool) -> dict[str, Any]:
    """One embedded and one deployment run with ``nodes`` clients; their figures."""
    first = 2
    t0 = time.perf_counter()
    run(PRESET, overrides(out, f"emb{nodes}", nodes, rounds), overwrite=True, progress=False)
    emb_wall = time.perf_counter() - t0
    emb_dir = Path(out) / f"emb{nodes}"

    work = Path(out) / f"deploy{nodes}"
    port = P.free_port()
    procs: list[P.Proc] = []
    try:
        node0: list[P.Proc] = []
        for i in range(nodes):
            started = D.start_client(
                f"127.0.0.1:{port}", i, nodes, work / f"node{i}", work / "logs", paced=paced
            )
            procs += started
            node0 = node0 or started
        for p in procs[1::2]:
            wait_ready(p)
        before = idle_rss(node0)
        cfg = load_config(PRESET, [*overrides(out, f"dep{nodes}", nodes, rounds), "runtime=flower"])
        parts = {p.popen.pid: "SuperNodes" for p in procs[0::2]}
        parts.update({p.popen.pid: "workers" for p in procs[1::2]})
        dep_dir = Path(out) / f"dep{nodes}"
        t0 = time.perf_counter()
        with RoundsCpu(dep_dir, rounds, parts) as cpu:
            D.serve(
                cfg,
                overwrite=True,
                options={"node_wait_s": 300, "timeout_s": 600},
                host="127.0.0.1",
                port=port,
                echo=False,
                work_dir=work / "serve",
                progress=False,
            )
        dep_wall = time.perf_counter() - t0
        after = idle_rss(node0)
    finally:
        P.stop(procs)
    n = exchanges(dep_dir, first)
    assert n == exchanges(emb_dir, first), "the two runs made different exchanges"
    dep_s, emb_s = round_seconds(dep_dir, first), round_seconds(emb_dir, first)
    return {
        "nodes": nodes,
        "exchanges": n,
        "per_exchange": (dep_s - emb_s) / n,
        "dep_per_exchange": dep_s / n,
        "emb_per_exchange": emb_s / n,
        "dep_wall": dep_wall,
        "emb_wall": emb_wall,
        "startup": dep_wall - round_seconds(dep_dir, 0),
        "equal": final(dep_dir) == final(emb_dir),
        "idle_before": before,
        "idle_after": after,
        "cpu": {part: secs / n for part, secs in sorted(cpu.per_part().items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[3, 10])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--supernode", choices=["fedfm", "flower"], default="fedfm")
    args = ap.parse_args()
    paced = args.supernode == "fedfm"
    load = [os.getloadavg()]
    results = []
    with tempfile.TemporaryDirectory(prefix="fedfm-deploy-overhead-") as out:
        run(PRESET, overrides(out, "warmup", 3, 1), overwrite=True, progress=False)
        for nodes in args.nodes:
            results.append(measure(out, nodes, args.rounds, paced))
            load.append(os.getloadavg())
    what = "fedfm's paced SuperNode" if paced else "Flower's flower-supernode"
    print(
        f"\n{PRESET}, {args.rounds} rounds, {what}, {os.cpu_count()} CPUs,"
        f" load average (1 min) {min(x[0] for x in load):.1f}-{max(x[0] for x in load):.1f}"
    )
    for r in results:
        print(
            f"{r['nodes']} SuperNodes: deployment {r['dep_wall']:.1f} s"
            f" (start-up {r['startup']:.1f} s), embedded {r['emb_wall']:.1f} s;"
            f" rounds 2-{args.rounds}: {r['exchanges']} exchanges,"
            f" {r['dep_per_exchange']:.3f} s each on the deployment engine,"
            f" {r['emb_per_exchange']:.3f} s embedded; final metrics equal: {r['equal']}"
        )
        cpu = ", ".join(f"{part} {secs:.3f} s" for part, secs in r["cpu"].items())
        print(f"  CPU per exchange, all processes of each part together: {cpu}")
    r0 = results[0]
    for when, key in (("before its first run", "idle_before"), ("after the run", "idle_after")):
        mib = r0[key]
        print(
            f"idle SuperNode {when}: {sum(mib):.0f} MiB resident"
            f" (SuperNode {mib[0]:.0f} MiB + warm worker {mib[1]:.0f} MiB)"
        )
    for r in results:
        print(f"overhead per exchange, {r['nodes']} SuperNodes: {r['per_exchange']:.3f} s")


if __name__ == "__main__":
    main()
