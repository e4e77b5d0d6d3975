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
part (the SuperLink; the ServerApp; Flower's SuperExec and the ``flwr`` CLI; the SuperNodes;
their workers), to tell waiting from work on a loaded machine.

Requests: the HTTP requests per exchange of those rounds, by sender and by endpoint. Every
hop of Flower 1.42's deployment engine is HTTP (ServerApp and SuperExec to the SuperLink,
SuperNodes to the SuperLink, workers to their SuperNode), each message and each of its
objects (records, arrays, array chunks) one request per hop, and each poll one request;
Flower's servers spend milliseconds of CPU on each, so the count is what the CPU follows,
and unlike wall time it does not grow with the machine's load. The deployment's processes
count their own requests (``request_count/sitecustomize.py``, put on their path).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import deploy_client as DC
from fedfm.runtime.flower import processes as P
from vs_flower import PeakRss  # this folder: the script's own

PRESET = "tabular-fedavg"
HERE = Path(__file__).resolve().parent
#: Where the deployment's processes write their request counts (request_count/).
COUNT_DIR = "FEDFM_REQUEST_COUNT_DIR"


def count_requests(folder: Path) -> None:
    """Makes every process started from here on count its HTTP requests into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[COUNT_DIR] = str(folder)
    path = [str(HERE / "request_count"), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)


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


#: Server-side processes by a word of their command line (the rest: SuperExec and CLI).
SERVER_PARTS = {"flower-superlink": "SuperLink", "flwr-serverapp": "ServerApp"}


def part_of(proc: psutil.Process, parts: dict[int, str]) -> str:
    """The part a deployment process belongs to."""
    if proc.pid in parts:
        return parts[proc.pid]
    cmd = " ".join(proc.cmdline())
    return next((v for k, v in SERVER_PARTS.items() if k in cmd), "SuperExec and flwr CLI")


@dataclass
class Read:
    """One look at a deployment process: its part, CPU seconds and requests sent so far."""

    part: str
    cpu: float
    requests: dict[str, int]


class RoundsCpu:
    """CPU seconds and HTTP requests of the deployment's processes in rounds 2..R, by part.

    Watches ``metrics.jsonl``: the processes below this one (SuperLink, ServerApp, SuperExec,
    the ``flwr`` CLI; SuperNodes; workers) are read when round 1's line appears and again
    when the last round's does.

    Args:
        run_dir: The deployment run's folder.
        rounds: Its rounds.
        parts: Process id -> part name for the SuperNodes and workers (others: by
            :data:`SERVER_PARTS`).
        counts: The folder where the processes write their request counts.
    """

    def __init__(self, run_dir: Path, rounds: int, parts: dict[int, str], counts: Path) -> None:
        self.run_dir, self.rounds, self.parts, self.counts = run_dir, rounds, parts, counts
        self.reads: list[dict[int, Read]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _requests(self, pid: int) -> dict[str, int]:
        path = self.counts / f"{pid}.json"
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(path.read_text()))
        return {}

    def _read(self) -> dict[int, Read]:
        time.sleep(0.25)  # the processes write their counts every 0.1 s
        out = {}
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                part = part_of(p, self.parts)
                out[p.pid] = Read(part, t.user + t.system, self._requests(p.pid))
        return out

    def _watch(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        for lines in (2, self.rounds + 1):  # round 0 and round 1 done; the last round done
            while not self._stop.is_set():
                if path.exists() and len(path.read_text().splitlines()) >= lines:
                    self.reads.append(self._read())
                    break
                self._stop.wait(0.05)

    def _deltas(self) -> list[tuple[Read, Read]]:
        if len(self.reads) < 2:
            return []
        a, b = self.reads
        return [(a[pid], r) for pid, r in b.items() if pid in a]

    def per_part(self) -> dict[str, float]:
        """Part -> CPU seconds between the two reads (processes alive at both)."""
        out: dict[str, float] = {}
        for was, now in self._deltas():
            out[now.part] = out.get(now.part, 0.0) + now.cpu - was.cpu
        return out

    def requests(self) -> dict[str, dict[str, int]]:
        """Sending part -> endpoint (``fleet/pull-object``) -> requests between the reads."""
        out: dict[str, dict[str, int]] = {}
        for was, now in self._deltas():
            mine = out.setdefault(now.part, {})
            for path, n in now.requests.items():
                key = path.removeprefix("/v1/")
                mine[key] = mine.get(key, 0) + n - was.requests.get(path, 0)
        return {part: {k: n for k, n in c.items() if n} for part, c in out.items()}

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
            started = DC.start_client(
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
        with RoundsCpu(dep_dir, rounds, parts, Path(os.environ[COUNT_DIR])) as cpu:
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
        "requests": {
            part: {k: c / n for k, c in sorted(kinds.items(), key=lambda x: -x[1])}
            for part, kinds in sorted(cpu.requests().items())
        },
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
        count_requests(Path(out) / "requests")
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
        total = sum(r["cpu"].values())
        print(f"  CPU per exchange, all processes of each part together: {total:.3f} s ({cpu})")
        sent = {part: sum(kinds.values()) for part, kinds in r["requests"].items() if kinds}
        print(f"  HTTP requests per exchange: {sum(sent.values()):.1f}, by sender:")
        for part, kinds in r["requests"].items():
            if kinds:
                each = ", ".join(f"{k} {c:.1f}" for k, c in kinds.items())
                print(f"    {part} {sent[part]:.1f}: {each}")
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
