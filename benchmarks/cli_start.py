"""How fast the ``fedfm`` command answers: help, list, report and refusals.

Each command runs as a new process (``python -m fedfm ...``, as the ``fedfm`` script does),
``--repeats`` times; the median wall time is printed with its ratio to ``python -c pass``
(the interpreter's own start on this machine, measured the same way, so a loaded machine
shows in both). The refusals are the ones an operator meets first: a bad config value, a
client with ``--insecure`` and an ``--auth-key``, a client with ``--insecure`` against a
SuperLink that uses TLS, a serve with an expired certificate, and a client without
``--auth-key`` against a SuperLink that authenticates nodes (both against a real SuperLink
with TLS and node authentication; the last refusal comes from the SuperNode, so it includes
starting one). ``import torch`` is
timed for comparison. The slowest of the commands that need no SuperNode is printed last.

Usage: .venv/bin/python benchmarks/cli_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower import tls as T

# This refusal comes from the SuperNode (it starts flwr), not from the command line.
WITH_SUPERNODE = "refused: client without --auth-key (SuperNode)"


def timed(argv: list[str], cwd: Path, expect: int) -> float:
    """Seconds one process takes; checks its exit code (a benchmark of the wrong thing
    would be worthless)."""
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    if out.returncode != expect:
        raise SystemExit(f"{' '.join(argv)}: exit {out.returncode}, expected {expect}:\n{out}")
    return took


def medians(
    commands: dict[str, tuple[list[str], int]], cwd: Path, repeats: int
) -> dict[str, float]:
    """Median seconds of each command, the commands taken in turn ``repeats`` times (so that
    a machine whose load changes weighs on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, (argv, code) in commands.items():
            times[name].append(timed(argv, cwd, code))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    fedfm = [sys.executable, "-m", "fedfm"]
    with tempfile.TemporaryDirectory(prefix="fedfm-cli-start-") as tmp:
        work = Path(tmp)
        for name in ("a", "b"):  # two real runs for `fedfm report`
            timed([*fedfm, "run", "tabular-fedavg", "rounds=1", f"name={name}", "-q"], work, 0)
        tls = T.make_certificates(work / "certs")
        key, _ = T.make_node_key(work / "certs", "node0")
        now = dt.datetime.now(dt.UTC)
        T.make_certificates(work / "expired", start=now - dt.timedelta(days=2), days=1)
        client = [*fedfm, "client", "--partition-id", "0", "--num-partitions", "1"]
        commands = {
            "python -c pass": ([sys.executable, "-c", "pass"], 0),
            "fedfm --help": ([*fedfm, "--help"], 0),
            "fedfm list": ([*fedfm, "list"], 0),
            "fedfm report a b": ([*fedfm, "report", "runs/a", "runs/b", "--out", "cmp"], 0),
            "refused: run train.lr=-1": ([*fedfm, "run", "tabular-fedavg", "train.lr=-1"], 2),
            "refused: client --insecure --auth-key": (
                [*client, "--superlink", "127.0.0.1:1", "--insecure", "--auth-key", str(key)],
                2,
            ),
            "refused: serve, expired certificate": (
                [*fedfm, "serve", "tabular-fedavg", "--certificates", "expired", "--port", "1"],
                2,
            ),
        }
        # A SuperLink with TLS and node authentication, as `fedfm serve` starts it.
        port = P.free_port()
        link = D.start_superlink(work / "link", work / "logs", "127.0.0.1", port, tls, True)
        at = [*client, "--superlink", f"127.0.0.1:{port}"]
        commands["refused: client --insecure, TLS server"] = ([*at, "--insecure"], 2)
        commands["python -c 'import torch'"] = ([sys.executable, "-c", "import torch"], 0)
        no_key = [*at, "--root-certificates", str(tls.ca_cert)]
        commands[WITH_SUPERNODE] = (no_key, 2)
        try:
            times = medians(commands, work, args.repeats)
        finally:
            P.stop([link])
    base = times["python -c pass"]
    for name, secs in times.items():
        print(f"{name:<48} {secs:6.2f} s  {secs / base:6.1f}x python -c pass")
    fast = {n: t for n, t in times.items() if n.startswith(("fedfm", "refused"))}
    fast.pop(WITH_SUPERNODE)
    worst = max(fast, key=lambda n: fast[n])
    print(
        f"slowest command without a SuperNode: {worst}: {fast[worst]:.2f} s,"
        f" {fast[worst] / base:.1f}x python -c pass (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
