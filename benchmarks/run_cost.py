"""What one ``fedfm run`` costs: wall time, time per round, peak memory and bytes, measured.

Runs ``fedfm run PRESET [OVERRIDES...] --overwrite -q`` in a child process and prints the wall
time of the whole command (imports, model loading and any one-off conversion included), each
round's ``time_s`` from ``metrics.jsonl``, the child's peak resident set size
(``ru_maxrss``), the load average before and after (on a shared machine it explains most of
the spread), the audit ledger's bytes per client and round, and the run's metrics at round 0
and at the last round; then it builds the task's model once more in this process and prints
its parameter counts (frozen and trainable). This is the command that prints the cost figures
of docs/quickstart.md.

Usage: .venv/bin/python benchmarks/run_cost.py PRESET [key=value ...] [--out runs/cost]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", default="runs/cost", help="out_dir of the run")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "fedfm.cli", "run", args.preset, *args.overrides]
    cmd += [f"out_dir={args.out}", "--overwrite", "-q"]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    if done.returncode:
        sys.exit(done.returncode)
    summary = json.loads(next(Path(args.out).glob("*/summary.json")).read_text())
    folder = Path(args.out) / summary["name"]
    rows = _rows(folder / "metrics.jsonl")
    print(f"command: {' '.join(cmd[1:])}")
    print(f"wall time: {wall:.1f} s ({wall / 60:.0f} min {wall % 60:.0f} s)")
    print(f"load average (1 min) before {load0[0]:.1f}, after {load1[0]:.1f}")
    print(f"peak RSS of the run: {peak_mb:,.0f} MB")
    for r in rows:
        loss = f", train_loss={r['train_loss']:.4g}" if "train_loss" in r else ""
        print(f"round {r['round']}: {r['time_s']:.1f} s{loss}")
    per: dict[tuple[int, str, str], int] = defaultdict(int)
    for a in _rows(folder / "audit.jsonl"):
        per[(a["round"], a["client"], a["direction"])] += a["bytes"]
    for d in ("up", "down"):
        counts = sorted({v for k, v in per.items() if k[2] == d and k[0] > 0})
        print(f"bytes {d} per client and round (audit ledger): {counts}")
    for r in (rows[0], rows[-1]):
        metrics = {k: v for k, v in r.items() if isinstance(v, float) and not k.endswith("_s")}
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        print(f"round {r['round']} metrics: {shown}")
    print_parameters(args.preset, args.overrides)


def print_parameters(preset: str, overrides: list[str]) -> None:
    """Frozen and trainable parameters of the run's model (as the task builds it)."""
    from fedfm.algorithms import algo_keys
    from fedfm.config import load_config
    from fedfm.engine import build

    model = build(load_config(preset, overrides, algo_keys)).task.build_model()
    params = list(model.parameters())
    train = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    print(f"model parameters: {frozen:,} frozen, {train:,} trainable")


if __name__ == "__main__":
    main()
