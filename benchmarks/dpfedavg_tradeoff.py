"""Accuracy against client-level ε: DP-FedAvg on the ``tabular-dpfedavg`` preset.

The preset (credit scoring, 300 clients of about 11 applicants, Poisson sampling at rate 0.2,
40 rounds, an MLP) runs for each client-level ε in {1, 4, 8} and ∞ (clipping without noise),
with a fixed bound (C = 0.5) and with adaptive clipping (Andrew et al. 2021: the bound starts at
0.1 and follows the noised median of the update norms), the noise added by a trusted server
(``mode: server``) or by the clients (``mode: client``, each its share z·C/√20, at least 20
replies per round), for several seeds. Plain FedAvg (no clipping, no noise, clients weighted
by size) is the reference. Each cell is the global model's test accuracy after the last round:
mean ± standard error over seeds. The ε is the aggregate's (what an observer of the models, or
a server behind secure aggregation, faces), at δ = 1e-4.

The table is written into ``docs/privacy.md`` between its ``tradeoff`` markers and printed;
the ratio printed last is the accuracy at ε = 4 (fixed bound, server noise) over plain FedAvg's.

Usage: .venv/bin/python benchmarks/dpfedavg_tradeoff.py [--seeds 0 1 2] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfm.config import load_config
from fedfm.runtime import run

PRESET = "tabular-dpfedavg"
EPSILONS: list[float | None] = [1.0, 4.0, 8.0, None]  # None: no noise (ε = ∞)
CLIPPING = {
    "fixed": [],
    "adaptive": ["privacy.user_level.clip=0.1", "privacy.user_level.adaptive={}"],
}
MODES = ["server", "client"]
DOC = Path(__file__).resolve().parent.parent / "docs" / "privacy.md"
START, END = "<!-- tradeoff:start -->", "<!-- tradeoff:end -->"


def overrides(eps: float | None, clipping: str, mode: str) -> list[str]:
    """The preset's overrides of one cell."""
    noise = (
        [f"privacy.user_level.epsilon={eps}"]
        if eps is not None
        else ["privacy.user_level.epsilon=null", "privacy.user_level.noise_multiplier=0"]
    )
    return [*noise, *CLIPPING[clipping], f"privacy.user_level.mode={mode}"]


def accuracy(out: Path, name: str, seed: int, over: list[str]) -> tuple[float, dict[str, Any]]:
    """Final test accuracy of one run, and its summary's privacy figures."""
    cfg = load_config(
        PRESET, [f"name={name}", f"out_dir={out}", f"seed={seed}", "plots=false", *over]
    )
    summary = run(cfg, progress=False)
    priv = json.loads((out / name / "privacy.json").read_text()) if "privacy" in summary else {}
    return float(summary["final"]["acc"]), priv.get("user_level", {})


def mean_se(xs: list[float]) -> str:
    """``mean ± SE`` (SE = sample std / √n)."""
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / math.sqrt(len(xs)):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--no-docs", action="store_true", help="print only; leave docs/privacy.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results: dict[tuple[str, str, str], list[float]] = {}
    noise: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for seed in args.seeds:
            acc, _ = accuracy(out, f"plain-{seed}", seed, ["privacy.user_level=null"])
            results.setdefault(("plain FedAvg", "", "-"), []).append(acc)
            for clipping in CLIPPING:
                for mode in MODES:
                    for eps in EPSILONS:
                        if eps is None and mode == "client":
                            continue  # without noise both modes are the same run
                        name = f"{clipping}-{mode}-{eps}-{seed}"
                        acc, note = accuracy(out, name, seed, overrides(eps, clipping, mode))
                        col = "∞" if eps is None else f"{eps:g}"
                        row = "server or client" if eps is None else mode
                        results.setdefault((clipping, row, col), []).append(acc)
                        noise[(clipping, col)] = float(note.get("noise_multiplier", 0.0))
                        print(f"{name}: acc={acc:.4f}", flush=True)
    cols = ["1", "4", "8", "∞"]
    lines = [
        "| clipping | noise added by | " + " | ".join(f"ε = {c}" for c in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for clipping in CLIPPING:
        for mode in MODES:
            cells = []
            for c in cols:
                key = (clipping, "server or client" if c == "∞" else mode, c)
                cells.append(mean_se(results[key]) if key in results else "")
            lines.append(f"| {clipping} | {mode} | " + " | ".join(cells) + " |")
    plain = results[("plain FedAvg", "", "-")]
    lines.append(f"| plain FedAvg (no clipping, no noise) | - | | | | {mean_se(plain)} |")
    zs = ", ".join(f"ε = {c}: z = {noise[('fixed', c)]:.3f}" for c in cols[:3])
    minutes = (time.perf_counter() - t0) / 60
    table = "\n".join(lines)
    text = (
        f"{table}\n\nNoise multipliers calibrated by dp-accounting (RDP, 40 rounds, q = 0.2, "
        f"δ = 1e-4): {zs}. Seeds {', '.join(map(str, args.seeds))}; measured in "
        f"{minutes:.1f} min on one thread by `python benchmarks/dpfedavg_tradeoff.py`."
    )
    print(text)
    if not args.no_docs:
        doc = DOC.read_text()
        block = f"{START}\n{text}\n{END}"
        doc = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
        DOC.write_text(doc)
    dp4 = statistics.mean(results[("fixed", "server", "4")])
    print(
        f"accuracy at epsilon 4 (fixed, server) / plain FedAvg: {dp4 / statistics.mean(plain):.3f}"
    )


if __name__ == "__main__":
    main()
