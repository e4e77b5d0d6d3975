"""Seconds from ``fedfm serve`` to round 0, and from the last round to its exit, on loopback.

The deployment an operator runs: ``fedfm flower-certs`` makes a CA, a SuperLink certificate
and node keys; N ``fedfm client`` commands (TLS and node authentication) start first and
wait for the server; then ``fedfm serve tabular-fedavg`` starts with their public keys.
Measured from outside, as an operator sees it:

- start-up: from the start of ``fedfm serve`` (once the clients wait: they said so, and
  use under 5 % of a CPU) until round 0's line is in the run folder's
  ``metrics.jsonl`` (SuperLink start, key registration, ``flwr run``, the ServerApp
  process, the wait for the SuperNodes, handshakes, task builds, round 0 itself);
- teardown: from the last round's line until ``fedfm serve`` has exited.

Each run also prints its phases, in seconds from the start of ``fedfm serve``, read from
the SuperLink's log that serve keeps in ``runs/<name>/flower_logs/`` (its requests are
time-stamped): the SuperLink listens; the run is submitted (``start-run``); the ServerApp
takes it (``pull-task-input``); the last SuperNode is in (``activate-node``); the first
message reaches a SuperNode (``get-run``); round 0 is logged. And the CPU seconds that the
processes of serve and of the clients used from serve's start to round 0 (what a loaded
machine does not change much, unlike the wall time; at most 2 s of them per second here).

``--src DIR`` (repeatable) runs the whole measurement with the fedfm sources of ``DIR``
first on ``PYTHONPATH`` (e.g. an unmodified checkout, then a changed one), alternating
``--repeat`` times, so that the figures of two versions come from the same sitting on a
shared machine. The figures are printed last, with the machine's load average.

Usage: .venv/bin/python benchmarks/deploy_startup.py [--nodes 3] [--rounds 2]
       [--src DIR ...] [--repeat 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedfm.runtime.flower import processes as P

PRESET = "tabular-fedavg"
HERE = Path(__file__).resolve().parent


def fedfm(src: str, *args: str) -> list[str]:
    """The ``fedfm`` command with ``src``'s sources (``python -m fedfm``)."""
    del src  # on PYTHONPATH (see env)
    return [sys.executable, "-m", "fedfm", *args]


def env_for(src: str, tmp: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    env.pop("FEDFM_REQUEST_COUNT_DIR", None)
    return env


def lines_of(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def wait_all(procs: list[subprocess.Popen], logs: list[Path], word: str, limit_s: float) -> None:
    """Waits until every client's output holds ``word`` (it is up and waiting)."""
    deadline = time.monotonic() + limit_s
    while not all(word in p.read_text(errors="replace") for p in logs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("clients not waiting:\n" + "\n".join(p.read_text() for p in logs))
        time.sleep(0.1)


#: Phases of the start-up: a SuperLink log line (flwr 1.42) that marks the end of each.
PHASES = {
    "superlink up": "Uvicorn running on",
    "run submitted": "/v1/control/start-run ",
    "ServerApp took it": "/v1/runtime/pull-task-input ",
    "nodes in": "/v1/fleet/activate-node ",
    "first message at a node": "/v1/fleet/get-run ",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z ")


def phases(run_dir: Path, t0: float, round0: float) -> dict[str, float]:
    """Seconds from ``t0`` (wall clock) to the end of each phase (see the module's
    docstring); a phase whose line is not in the log is left out."""
    out: dict[str, float] = {}
    for log in sorted(run_dir.glob("flower_logs/*/superlink.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m is None:
                continue
            when = datetime.datetime.fromisoformat(m.group(1) + "+00:00").timestamp() - t0
            if when > round0 - t0:  # only the start-up
                break
            for name, mark in PHASES.items():
                # Nodes: the last one in; the others: the first line.
                if mark in line and (name == "nodes in" or name not in out):
                    out[name] = when
    out["round 0 logged"] = round0 - t0
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (from ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *P.descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def wait_idle(procs: list[subprocess.Popen], limit_s: float, window_s: float = 2.0) -> None:
    """Waits until the clients (and what they started ahead, e.g. warm workers importing
    torch) use less than 5 % of a CPU over ``window_s``: they wait, nothing else."""
    deadline = time.monotonic() + limit_s
    before = sum(cpu_s(p.pid) for p in procs)
    while time.monotonic() < deadline:
        time.sleep(window_s)
        now = sum(cpu_s(p.pid) for p in procs)
        if now - before < 0.05 * window_s:
            return
        before = now
    raise SystemExit(f"the clients were still busy after {limit_s:.0f} s")


def measure(src: str, work: Path, nodes: int, rounds: int) -> tuple[float, float, dict]:
    """One deployment on loopback; ``(start-up s, teardown s, phases)``."""
    work.mkdir(parents=True)
    (work / "tmp").mkdir()
    env = env_for(src, work / "tmp")
    certs = work / "certs"
    hosts = ["--host", "127.0.0.1", "--host", "localhost"]
    subprocess.run(
        fedfm(src, "flower-certs", str(certs), *hosts, "--nodes", str(nodes)),
        env=env, cwd=work, check=True, capture_output=True,
    )  # fmt: skip
    port = P.free_port()
    clients: list[subprocess.Popen] = []
    logs = [work / f"client{i}.log" for i in range(nodes)]
    try:
        for i, log in enumerate(logs):
            with log.open("w") as out:
                cmd = fedfm(
                    src, "client", "--superlink", f"127.0.0.1:{port}",
                    "--root-certificates", str(certs / "ca.crt"),
                    "--auth-key", str(certs / f"node{i}.key"),
                    "--partition-id", str(i), "--num-partitions", str(nodes),
                    "--state-dir", str(work / f"states{i}"), "--wait", "600",
                )  # fmt: skip
                clients.append(subprocess.Popen(cmd, env=env, cwd=work, stdout=out, stderr=out))
        wait_all(clients, logs, "waiting for the server", 300)
        wait_idle(clients, 300)
        keys = [a for i in range(nodes) for a in ("--node-key", str(certs / f"node{i}.pub"))]
        serve = fedfm(
            src, "serve", PRESET, "--host", "127.0.0.1", "--port", str(port),
            "--certificates", str(certs), *keys, "--quiet",
            f"partition.num_clients={nodes}", "clients.min_clients=1", f"rounds={rounds}",
            f"out_dir={work / 'runs'}", "name=startup", "plots=false",
        )  # fmt: skip
        metrics = work / "runs" / "startup" / "metrics.jsonl"
        with (work / "serve.log").open("w") as out:
            cpu0 = sum(cpu_s(c.pid) for c in clients)
            t0, wall0 = time.monotonic(), time.time()
            proc = subprocess.Popen(serve, env=env, cwd=work, stdout=out, stderr=out)
            first = last = None
            round0 = cpu = 0.0
            while proc.poll() is None:
                n = lines_of(metrics)
                now = time.monotonic()
                if n >= 1 and first is None:
                    first, round0 = now, time.time()
                    cpu = cpu_s(proc.pid) + sum(cpu_s(c.pid) for c in clients) - cpu0
                if n >= rounds + 1 and last is None:
                    last = now
                time.sleep(0.02)
            end = time.monotonic()
        if proc.returncode != 0 or first is None or last is None:
            raise SystemExit(
                f"serve failed ({proc.returncode}):\n{(work / 'serve.log').read_text()}"
            )
        when = phases(work / "runs" / "startup", wall0, round0)
        when["CPU s to round 0"] = cpu
        return first - t0, end - last, when
    finally:
        for c in clients:
            c.terminate()
        for c in clients:
            c.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--src", action="append", help="fedfm sources to measure (repeatable)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (logs)")
    args = ap.parse_args()
    srcs = args.src or [str(HERE.parent / "src")]
    figures: dict[str, list[tuple[float, float]]] = {s: [] for s in srcs}
    steps: dict[str, list[dict]] = {s: [] for s in srcs}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fedfm-deploy-startup-") as tmp:
        out = args.keep or tmp
        for k in range(args.repeat):
            for j, src in enumerate(srcs):
                work = Path(out) / f"{k}-{j}"
                up, down, when = measure(src, work, args.nodes, args.rounds)
                figures[src].append((up, down))
                steps[src].append(when)
                load.append(os.getloadavg()[0])
                print(f"{src}: start-up {up:.1f} s, teardown {down:.1f} s", flush=True)
                print("  s from serve: " + ", ".join(f"{k} {v:.1f}" for k, v in when.items()))
    print(
        f"\n{PRESET}, {args.nodes} waiting clients (TLS, node authentication), {args.rounds}"
        f" rounds, {os.cpu_count()} CPUs, load average (1 min) {min(load):.1f}-{max(load):.1f}"
    )
    for src, runs in figures.items():
        ups, downs = [u for u, _ in runs], [d for _, d in runs]
        print(
            f"{src}: serve to round 0 {statistics.median(ups):.1f} s"
            f" (runs: {', '.join(f'{u:.1f}' for u in ups)}), last round to exit"
            f" {statistics.median(downs):.1f} s (runs: {', '.join(f'{d:.1f}' for d in downs)})"
        )
        names = [k for k in steps[src][0] if all(k in w for w in steps[src])]
        print(
            "  phases, median s from serve: "
            + ", ".join(f"{k} {statistics.median(w[k] for w in steps[src]):.1f}" for k in names)
        )


if __name__ == "__main__":
    main()
